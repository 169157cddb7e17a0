# Two commands do all the set-up (see README):
#   make train   - the main job: a short MoE training run on embedded local Ray
#   make test    - the static type check (mypy, settings in pyproject.toml), then the test suite
#   make bench   - a small MoE-layer benchmark on CPU (docs/engine.md, "Benchmarking the layer")
# Each creates .venv and installs the project into it when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# Empty: torch from the default index (a CPU build only where that index serves one).
# make TORCH_INDEX=https://download.pytorch.org/whl/cpu train  asks for the CPU build.
TORCH_INDEX ?=

.PHONY: train test test-fast typecheck bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[ray,test]"
	$(PY) -m compileall -q -j 2 $(VENV)/lib > /dev/null || true
	touch $(STAMP)
	@echo "installed; put mpipemoe on PATH in your shell with: source $(VENV)/bin/activate"

train: $(STAMP)
	$(VENV)/bin/mpipemoe train

# mypy first: it takes seconds with a warm cache (.mypy_cache/) and fails on a changed
# signature that only a GPU test calls (issue 28).
typecheck: $(STAMP)
	$(PY) -m mypy

# Two test processes (pytest-xdist), each taking whole modules (a module's fixtures start once):
# a Ray Train job's start leaves one of two cores idle about half its time (README, Tests).
# Modules go out in collection order, the longest first (tests/conftest.py LONGEST_MODULES_FIRST),
# not xdist's default of the modules with the most tests first.
PYTEST_PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder

test: typecheck
	$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not ray"

bench: $(STAMP)
	$(VENV)/bin/mpipemoe bench --tokens 256 --partitions 1,2 --strategies none,S3 --rounds 1 --repeats 1 --tracking-uri none

clean:
	rm -rf $(VENV) mlflow.db mlruns .pytest_cache .mypy_cache
