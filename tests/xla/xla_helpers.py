"""Shared helpers of the xla tests."""

import os
import time

import pytest

from atoll.node.device import xla_available

REQUIRED = os.environ.get("ATOLL_REQUIRE_XLA") == "1"
xla_only = pytest.mark.skipif(
    not xla_available() and not REQUIRED,
    reason="torch_xla is not installed in this environment; `make test-xla` runs these in the xla venv",
)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def peer_id(d):
    return d.maddrs[0].rsplit("/", 1)[1]
