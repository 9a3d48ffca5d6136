"""Shared test set-up: one torch thread per process (the machine has 2 cores shared by daemons)."""

import os
import sys
import types
from pathlib import Path

import pytest
import torch
from _pytest._code import ExceptionInfo

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # the swarm launcher doubles as the integration harness
os.environ.setdefault("PYTHONUNBUFFERED", "1")


def _lines_mended(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` again, with every entry that has no line number given its function's first line."""
    if tb is None:
        return None
    rest = _lines_mended(tb.tb_next)
    if tb.tb_lineno is not None:
        return types.TracebackType(rest, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    # No instruction either (-1): its position has no line to point at.
    return types.TracebackType(rest, tb.tb_frame, -1, tb.tb_frame.f_code.co_firstlineno)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Give traceback entries that have no line number one before pytest renders a failure.

    On Python 3.11 an exception raised while a frame sits on an instruction without a line (pytest-timeout's
    signal landing there, for one) carries ``tb_lineno is None``; pytest then fails rendering it with an
    INTERNALERROR that ends the whole session, hiding which test failed and skipping every test after it."""
    if call.excinfo is not None:
        seen, exc = set(), call.excinfo.value
        while exc is not None and id(exc) not in seen:  # the chain pytest renders: causes and contexts
            seen.add(id(exc))
            exc.__traceback__ = _lines_mended(exc.__traceback__)
            exc = exc.__cause__ or exc.__context__
        value = call.excinfo.value
        call.excinfo = ExceptionInfo.from_exc_info((type(value), value, value.__traceback__))
    return (yield)
