# `make test` and `make demo` build .venv from nothing when it is missing (or pyproject.toml changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The xla environment: torch_xla 2.9.0 pins torch 2.9.0 (~7 GB installed), so it is a second venv, kept outside
# the clone (a fresh clone, as CI makes, reuses it). It holds the dependencies only, never a clone's code: each
# run puts its own clone on PYTHONPATH (build/xla-path/atoll/* are links to node/, protocols/, models/), so two
# clones can use it at once and it always tests the code of the clone that runs it. Its stamp is keyed on
# pyproject.toml's content (and this recipe's version), not its mtime: a change re-runs pip in the same venv
# (cheap: torch is already there).
XLA_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/atoll/venv-xla
XLA_PY := $(XLA_VENV)/bin/python
XLA_KEY := $(shell (echo xla-venv-2; cat pyproject.toml) | sha256sum | cut -c1-16)
XLA_STAMP := $(XLA_VENV)/.installed-$(XLA_KEY)
XLA_PATH := build/xla-path

.PHONY: system-packages test test-fast test-unit test-integration test-xla xla-venv demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# No prerequisite on pyproject.toml: a fresh clone's file is always newer than the stamp. The key is the content.
$(XLA_STAMP):
	test -x $(XLA_PY) || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install --quiet 'torch==2.9.0' 'torch_xla==2.9.0'
	# pip resolves the dependencies from pyproject.toml; atoll itself is then removed again (see above).
	$(XLA_PY) -m pip install --quiet -e '.[xla,test]'
	$(XLA_PY) -m pip uninstall --quiet --yes atoll
	rm -f $(XLA_VENV)/.installed-*
	touch $(XLA_STAMP)

xla-venv: $(XLA_STAMP)

# System packages a test needs: nft (nftables) for the WAN emulator's NAT regions (tests/unit/test_wan.py);
# Debian's chromium and its chromedriver for the dashboard's browser test (tests/integration/test_dashboard.py).
SYSTEM_PACKAGES := $(if $(shell command -v nft),,nftables) \
	$(if $(shell command -v chromium),,chromium) $(if $(shell command -v chromedriver),,chromium-driver)
system-packages:
	$(if $(strip $(SYSTEM_PACKAGES)),apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		$(strip $(SYSTEM_PACKAGES)),@true)

# The unit tests compute and never wait: on as many workers as the machine has cores. The integration tests whose
# daemons leave a quarter of the cores idle or more (marked `waits`: cpu_busy 0.75 or less alone, in
# build/test-durations.json) two at a time, a module to a worker; the others, which keep the cores busy, one at a
# time (two of those at once ran no faster, and slowed twelve daemons' start past its bound). The xla tests run in
# their own environment (test-xla).
test: $(STAMP) system-packages
	$(PY) -m pytest -q -n auto tests/unit
	$(PY) -m pytest -q -n 2 --dist loadfile -m waits tests/integration
	$(PY) -m pytest -q -m "not waits" tests/integration tests/xla
	$(MAKE) test-xla

# The xla tests run on torch_xla's real compiler and runtime on the CPU (PJRT_DEVICE=CPU). ATOLL_REQUIRE_XLA turns
# a missing torch_xla into failures instead of skips.
test-xla: $(XLA_STAMP)
	mkdir -p $(XLA_PATH)/atoll
	for p in node protocols models; do ln -sfn ../../../$$p $(XLA_PATH)/atoll/$$p; done
	ln -sfn ../../../atoll/__init__.py $(XLA_PATH)/atoll/__init__.py
	PYTHONPATH=$(CURDIR)/$(XLA_PATH) PJRT_DEVICE=CPU ATOLL_REQUIRE_XLA=1 $(XLA_PY) -m pytest -q tests/xla tests/unit/test_xla.py

test-unit: $(STAMP) system-packages
	$(PY) -m pytest -q tests/unit

# The inner loop: the unit tests on as many workers as the machine has cores (pytest-xdist), no sockets.
test-fast: $(STAMP) system-packages
	$(PY) -m pytest -q -n auto tests/unit

test-integration: $(STAMP) system-packages
	$(PY) -m pytest -q tests/integration

demo: $(STAMP)
	$(PY) -m scripts.swarm --daemons 3 --duration 180

bench: $(STAMP)
	$(PY) -m scripts.bench_parity

clean:
	rm -rf $(VENV) runs .pytest_cache
