# `make demo` and `make test` each set up .venv on first use (CPU wheels), then run; `make test` also
# sets up .venv-notorch, the JAX side without torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU machine's pins: torch 2.13 (a CPU wheel), triton matching the GPU image, JAX 0.10 for Python 3.11.
JAX_PINS := triton==3.6.0 "jax[cpu]>=0.10,<0.11"
PINS := torch==2.13.0 $(JAX_PINS)
# The JAX suite once more where torch is not installed (tests that need torch skip, saying why).
NOTORCH_VENV ?= .venv-notorch
NOTORCH_PY := $(NOTORCH_VENV)/bin/python
NOTORCH_TESTS := tests/test_jax_*.py tests/test_flax_modules.py tests/test_reference_jax.py tests/test_bench_jax.py \
	tests/test_errors.py tests/test_first_hour.py tests/test_selection.py tests/test_layout.py tests/test_options.py \
	tests/test_mask_rewrite.py tests/test_flex_score_mods.py tests/test_small_seq_interpreter.py tests/test_fuzz.py \
	tests/test_cli.py

.PHONY: demo test lint gpu-test clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PINS)
	$(PY) -m pip install --quiet -e ".[torch,jax,dev]"
	touch $@

# Without torch: the jax extra, pinned as above, and the test tools; checked to hold no torch.
$(NOTORCH_VENV)/.installed: pyproject.toml Makefile .ci/check_no_torch.py
	rm -rf $(NOTORCH_VENV)
	$(PYTHON) -m venv $(NOTORCH_VENV)
	$(NOTORCH_PY) -m pip install --quiet --upgrade pip
	$(NOTORCH_PY) -m pip install --quiet $(JAX_PINS)
	$(NOTORCH_PY) -m pip install --quiet -e ".[jax,dev]"
	$(NOTORCH_PY) -m pip inspect > $(NOTORCH_VENV)/inspect.json
	$(NOTORCH_PY) .ci/check_no_torch.py $(NOTORCH_VENV)/inspect.json $(NOTORCH_VENV)
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# The CPU suites in TEST_WORKERS processes (pytest-xdist): on the 2-core CI machine the torch suite takes
# about 22 minutes so, 33 in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed $(NOTORCH_VENV)/.installed
	$(PY) -m ruff check fusedattn tests examples bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests
	$(PY) -m pip install --dry-run --ignore-installed -qq --report $(VENV)/jax-cudnn-report.json -e ".[jax,cudnn]"
	$(PY) .ci/check_no_torch.py $(VENV)/jax-cudnn-report.json 'a fresh pip install -e ".[jax,cudnn]"'
	$(NOTORCH_PY) -m pytest -q -n $(TEST_WORKERS) $(NOTORCH_TESTS)

lint: $(VENV)/.installed
	$(PY) -m ruff check fusedattn tests examples bench

# On a GPU machine: the tests marked gpu, in GPU_WORKERS processes sharing the GPU (pytest-xdist;
# graph builds are host-bound, so the suite fits one 10-minute call), summary for bench/results.
GPU_WORKERS ?= 6
gpu-test:
	$(PYTHON) -m pytest -q -m gpu -n $(GPU_WORKERS) -p no:cacheprovider tests/gpu

clean:
	rm -rf $(VENV) $(NOTORCH_VENV) .pytest_cache
