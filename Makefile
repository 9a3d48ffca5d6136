# `make test` and `make demo` build .venv from nothing when it is missing (or pyproject.toml changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The xla environment: torch_xla 2.9.0 pins torch 2.9.0 (~7 GB installed), so it is a second venv, kept outside
# the clone (a fresh clone, as CI makes, reuses it). Its stamp is keyed on pyproject.toml's content, not its
# mtime: a changed pyproject.toml re-runs pip in the same venv (cheap: torch is already there).
XLA_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/atoll/venv-xla
XLA_PY := $(XLA_VENV)/bin/python
XLA_KEY := $(shell sha256sum pyproject.toml | cut -c1-16)
XLA_STAMP := $(XLA_VENV)/.installed-$(XLA_KEY)

.PHONY: test test-unit test-integration test-xla xla-venv demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# No prerequisite on pyproject.toml: a fresh clone's file is always newer than the stamp. The key is the content.
$(XLA_STAMP):
	test -x $(XLA_PY) || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install --quiet 'setuptools>=68' wheel 'torch==2.9.0' 'torch_xla==2.9.0'
	$(XLA_PY) -m pip install --quiet -e '.[xla,test]'
	rm -f $(XLA_VENV)/.installed-*
	touch $(XLA_STAMP)

xla-venv: $(XLA_STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(MAKE) test-xla

# The xla tests run on torch_xla's real compiler and runtime on the CPU (PJRT_DEVICE=CPU). The shared venv is
# pointed at this clone every time (an editable install, no dependencies: a few seconds), so it tests this
# clone's code, never the clone that built the venv. ATOLL_REQUIRE_XLA turns a missing torch_xla into a failure.
test-xla: $(XLA_STAMP)
	$(XLA_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	PJRT_DEVICE=CPU ATOLL_REQUIRE_XLA=1 $(XLA_PY) -m pytest -q tests/xla tests/unit/test_xla.py

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

demo: $(STAMP)
	$(PY) scripts/swarm.py --daemons 3 --duration 180

bench: $(STAMP)
	$(PY) scripts/bench_parity.py

clean:
	rm -rf $(VENV) runs .pytest_cache
