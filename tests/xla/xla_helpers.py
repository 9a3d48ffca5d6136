"""Shared helpers of the xla tests."""

import os

import pytest

from atoll.node.device import xla_available

REQUIRED = os.environ.get("ATOLL_REQUIRE_XLA") == "1"
xla_only = pytest.mark.skipif(
    not xla_available() and not REQUIRED,
    reason="torch_xla is not installed in this environment; `make test-xla` runs these in the xla venv",
)
