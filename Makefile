# Two commands do all the set-up on a fresh machine with Python >= 3.11:
#   make demo   creates .venv, installs jspec, runs the main job
#   make test   creates .venv, installs jspec with its test extra, runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/jspec demo

test: $(VENV)/.test
	$(PY) -m pytest

bench: $(VENV)/.base
	$(PY) -m jspec.benchmarks.ar_loop
	$(PY) -m jspec.benchmarks.verify_cost

clean:
	rm -rf $(VENV) demo_out .pytest_cache
