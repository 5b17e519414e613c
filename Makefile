# The README's two commands. Each creates .venv if needed and installs the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-dev lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

setup-dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

# Main job: a tiny headless and a tiny vanilla pretraining run on the shipped corpus, compared.
demo: setup
	$(BIN)/hlm compare --preset tiny-decoder --output runs/demo

test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check hlm_ray tests sweeps
	$(BIN)/ruff format --check hlm_ray tests sweeps
