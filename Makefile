# Two commands do all the set-up on a fresh machine with Python >= 3.11:
#   make demo   creates .venv, installs jspec, runs the main job (the built-in models, speculative vs AR)
#   make test   creates .venv, installs jspec with its test extra, runs the test suite
#               (and .venv-aot, the interpreter of the deviceless TPU / H200 compile tests)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench builtin clean lock

# Both install the exact versions of the lock files (reproducible), then jspec itself without resolving
# again; pyproject.toml's ranges are what `pip install jspec` next to another stack resolves.
$(VENV)/.base: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.test: pyproject.toml requirements-test.lock $(VENV)/.base
	$(PY) -m pip install -q -r requirements-test.lock
	touch $@

# A second interpreter for deviceless TPU / H200 compiles: the base venv's packages (through a .pth
# file) plus libtpu and the CUDA plugin, kept out of $(VENV) because with them every plain jax import
# probes for accelerators (slow, noisy).
AOT_PINS := libtpu==0.0.42.1 jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2

$(VENV)-aot/.done: $(VENV)/.base
	$(PYTHON) -m venv $(VENV)-aot
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$($(VENV)-aot/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/jspec-base.pth"
	$(VENV)-aot/bin/python -m pip install -q $(AOT_PINS)
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/jspec generate

# The suite runs in four worker processes (pytest-xdist, a test file per worker at a time, the conformance
# suite a family at a time: tests/conftest.py): tiny models are compile-bound and one process uses about 1.5
# of the 2 cores. --durations lists the slowest tests, to keep the suite's time in view.
test: $(VENV)/.test $(VENV)-aot/.done
	$(PY) -m pytest -n 4 --dist loadfile --durations=30

bench: $(VENV)/.base
	$(PY) -m jspec.benchmarks.ar_loop
	$(PY) -m jspec.benchmarks.verify_cost

# Retrain the built-in models from configs/ and install them (about 95 minutes on 2 CPU cores). The
# drafters share the DFlash run's distilled sequences (same target, data and distill sections). The
# corpus's "site-packages" is this venv's: the test lock's packages, so that a fresh clone trains on the
# same files.
builtin: $(VENV)/.test
	$(VENV)/bin/jspec train target --config configs/code-target.json --out runs/code-target
	$(VENV)/bin/jspec train dflash --config configs/code-dflash.json --target runs/code-target/model --out runs/code-dflash
	$(VENV)/bin/jspec train dspark --config configs/code-dspark.json --target runs/code-target/model --out runs/code-dspark \
		--distilled runs/code-dflash
	$(PY) -m jspec.train.upgrade runs/code-dflash/model runs/code-dflash2-init
	$(VENV)/bin/jspec train dflash2 --init runs/code-dflash2-init --config configs/code-dflash2.json \
		--target runs/code-target/model --out runs/code-dflash2 --distilled runs/code-dflash
	$(VENV)/bin/jspec train eagle3 --config configs/code-eagle3.json --target runs/code-target/model \
		--out runs/code-eagle3 --steps 200 --distilled runs/code-dflash
	$(VENV)/bin/jspec train mtp --config configs/code-mtp.json --target runs/code-target/model --out runs/code-mtp \
		--distilled runs/code-dflash
	$(PY) -m jspec.train.builtin runs/code-target/model runs/code-dflash/model runs/code-dspark/model \
		runs/code-dflash2/model runs/code-eagle3/model runs/code-mtp/model

# Re-resolve pyproject.toml's ranges (the newest releases they admit) in a fresh venv and write the lock
# files (the test lock with setuptools, which torch needs at run time); run the suite on the result before
# committing it. A local build's label (torch 2.13.0+cpu) is
# dropped so the lock also holds on machines that take the same release from the registry.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q .
	{ echo "# The exact set \`make demo\` installs (\`make lock\` writes it from pyproject.toml's ranges)."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude jspec | sed 's/+cpu$$//'; } > requirements.lock
	$(LOCK_VENV)/bin/pip install -q '.[test]'
	{ echo "# The exact set \`make test\` installs (\`make lock\` writes it from pyproject.toml's ranges)."; \
	  $(LOCK_VENV)/bin/pip freeze --all --exclude pip --exclude jspec | sed 's/+cpu$$//'; } > requirements-test.lock
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) $(VENV)-aot $(LOCK_VENV) demo_out .pytest_cache
