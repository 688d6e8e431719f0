# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench-matmul

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0 first: on the project's CPU machines this picks the local CPU wheel, and the
	# `test` extra's torch>=2.5 is then already satisfied.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m jattn.demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

# On a GPU machine with jax, torch and pytest already installed (no venv):
bench-matmul:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.bench_matmul
