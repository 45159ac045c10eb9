# Two commands do all the set-up on a fresh machine with Python >= 3.11:
#   make demo   creates .venv, installs jspec, runs the main job (the built-in models, speculative vs AR)
#   make test   creates .venv, installs jspec with its test extra, runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench builtin clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/jspec generate

# The suite runs in four worker processes (pytest-xdist, a test file per worker at a time): tiny models
# are compile-bound and one process uses about 1.5 of the 2 cores.
test: $(VENV)/.test
	$(PY) -m pytest -n 4 --dist loadfile

bench: $(VENV)/.base
	$(PY) -m jspec.benchmarks.ar_loop
	$(PY) -m jspec.benchmarks.verify_cost

# Retrain the built-in models from configs/ (about an hour on 2 CPU cores) and install them.
builtin: $(VENV)/.base
	$(VENV)/bin/jspec train target --config configs/code-target.json --out runs/code-target
	$(VENV)/bin/jspec train dflash --config configs/code-dflash.json --target runs/code-target/model --out runs/code-dflash
	$(VENV)/bin/jspec train dspark --config configs/code-dspark.json --target runs/code-target/model --out runs/code-dspark
	$(PY) -m jspec.train.builtin runs/code-target/model runs/code-dflash/model runs/code-dspark/model

clean:
	rm -rf $(VENV) demo_out .pytest_cache
