# `make demo` and `make test` each set up .venv on first use (CPU wheels), then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU machine's pins: torch 2.13 (a CPU wheel), triton matching the GPU image, JAX 0.10 for Python 3.11.
PINS := torch==2.13.0 triton==3.6.0 "jax[cpu]>=0.10,<0.11"

.PHONY: demo test lint gpu-test clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PINS)
	$(PY) -m pip install --quiet -e ".[torch,jax,dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m ruff check fusedattn tests examples bench
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(PY) -m ruff check fusedattn tests examples bench

# On a GPU machine: the tests marked gpu, summary for bench/results.
gpu-test:
	$(PYTHON) -m pytest -q -m gpu tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache
