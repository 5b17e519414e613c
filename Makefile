# The README's two commands. Each creates .venv if needed and installs the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-dev lint compare gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

setup-dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

# Main job: the tiny vocabulary-size ablation (paper Figure 7, V up to 32k), headless vs vanilla,
# on local Ray; prints the report and its two closing sentences.
demo: setup
	$(BIN)/python sweeps/vocab.py --preset tiny

# A tiny headless and a tiny vanilla decoder, pretrained side by side.
compare: setup
	$(BIN)/hlm compare --preset tiny-decoder --output runs/demo

test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check hlm_ray tests sweeps
	$(BIN)/ruff format --check hlm_ray tests sweeps

# On a CUDA machine: gpu tests, bf16 training, xformers vs sdpa, the GPU benchmark, a GPU sweep and
# hlm serve on the GPU; one PASS/MISS table. Without a GPU it says so and exits 0.
gpu-check: setup-dev
	$(BIN)/python -m hlm_ray.gpu_check
