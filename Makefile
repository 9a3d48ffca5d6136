# `make test` and `make demo` build .venv from nothing when it is missing (or pyproject.toml changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-unit test-integration demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

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
