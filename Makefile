# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench-matmul memcheck

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0 first: on the project's CPU machines this picks the local CPU wheel, and the
	# `test` extra's torch>=2.5 is then already satisfied.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m jattn.demo

# One worker per core, at most 4 (each holds its own JAX and torch); a test file stays on one
# worker, in order.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

# On a GPU machine with jax, torch and pytest already installed (no venv):
bench-matmul:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.bench_matmul

# On a GPU machine: every kernel family at small ragged shapes under compute-sanitizer's
# memcheck (a few minutes). The platform allocator gives each buffer its own allocation, so an
# access past an end is caught rather than landing in a neighbour inside XLA's pool.
SANITIZER ?= compute-sanitizer
# XLA's GEMM autotuning and CUDA command buffers are off: under the sanitizer XLA crashes in them.
memcheck:
	XLA_PYTHON_CLIENT_ALLOCATOR=platform PYTHONPATH=$(CURDIR) \
	  XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \
	  $(SANITIZER) --tool memcheck \
	  --error-exitcode 1 $(PYTHON) -m tests.memcheck
