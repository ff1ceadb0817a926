# torch_tpu: `make demo` and `make test` work on a fresh machine (they create .venv).
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.torch_tpu-installed
# Pinned: torch's CPU wheel is in the local pip cache; an unpinned torch pulls a CUDA build.
PINS := torch==2.13.0 jax==0.10.2 jaxlib==0.10.2
# Two pytest workers (pytest-xdist); --dist loadfile keeps each file's tests in one process, in order;
# --durations: every log ends with the slowest tests (where CI time goes).
TEST_WORKERS ?= 2
PYTEST_FLAGS ?= -n $(TEST_WORKERS) --dist loadfile --durations=15
# Extras `make install` installs, resolved together (titan: tests/test_torchtitan.py, heavy).
EXTRAS ?= test,titan

.PHONY: install demo test test-defer test-heavy test-all bench docs clean

$(STAMP): pyproject.toml setup.py torch_tpu/csrc/native.cpp torch_tpu/csrc/autocast.cpp torch_tpu/csrc/profiler.cpp
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q $(PINS) numpy setuptools wheel ninja
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PYTHON) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PYTHON) examples/train_gpt.py

# The fast suite, less the tests marked defer_pass (their Strict coverage is a heavy test's: the 1-sample
# OpInfo sweep, whose 10-sample Strict sweep runs in make test-heavy); make test-defer runs them.
test: install
	$(PYTHON) -m pytest -q -m "not heavy and not defer_pass" $(PYTEST_FLAGS) tests

# The same fast suite with every op recorded and fused (DeferAndFuse, docs/defer.md), less the
# tests marked one_mode (machinery no execution mode changes: they ran in the Strict pass).
test-defer: install
	TORCH_TPU_DEFER_AND_FUSE=1 $(PYTHON) -m pytest -q -m "not heavy and not one_mode" $(PYTEST_FLAGS) tests

test-heavy: install
	$(PYTHON) -m pytest -q -m heavy $(PYTEST_FLAGS) tests

test-all: test test-defer test-heavy

bench: install
	$(PYTHON) bench/op_overhead.py
	$(PYTHON) bench/modes.py
	$(PYTHON) bench/cold_warm.py
	$(PYTHON) bench/collectives.py
	$(PYTHON) bench/compile.py
	$(PYTHON) bench/value_checks.py
	$(PYTHON) bench/kernels.py

# The docs site from docs/ into site/ (MkDocs Material; strict: a warning or a broken link fails it).
DOCS_PKGS := mkdocs==1.6.1 mkdocs-material==9.8.2  # the `docs` extra of pyproject.toml

docs: install
	$(PYTHON) -m pip install -q $(DOCS_PKGS) $(PINS)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --clean

clean:
	rm -rf $(VENV) build *.egg-info torch_tpu/*.so site
