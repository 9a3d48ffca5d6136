"""Shared test set-up: one torch thread per process (the machine has 2 cores shared by daemons), and the device the
device tests train on.

``ATOLL_TEST_DEVICE`` (``cpu`` by default, or ``cuda``) is the device of every test that takes the ``device_name``
fixture; each such test is marked ``device`` here, so ``-m device`` selects exactly them. On ``cuda`` their
assertions are the CPU's, bit-exact comparisons of two runs included, so the GPU is made deterministic first.
A ``cuda`` run on a machine without a usable GPU is a usage error, never a run of skips.
"""

import os
import types
from pathlib import Path

import pytest
import torch
from _pytest._code import ExceptionInfo

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYTHONUNBUFFERED", "1")
TEST_DEVICES = ("cpu", "cuda")


def selected_device() -> str:
    """``ATOLL_TEST_DEVICE``; ``pytest.UsageError`` for a value that is not one of ``TEST_DEVICES``."""
    name = os.environ.get("ATOLL_TEST_DEVICE", "cpu")
    if name not in TEST_DEVICES:
        raise pytest.UsageError(f"ATOLL_TEST_DEVICE={name!r}: use one of {', '.join(TEST_DEVICES)} (default cpu)")
    return name


def pytest_configure(config):
    """Check ``ATOLL_TEST_DEVICE``; for ``cuda``, a GPU that computes the same bits on every run of the same steps."""
    if selected_device() != "cuda":
        return
    # Before CUDA starts: cuBLAS reads it when it makes its first handle. Deterministic algorithms make two runs
    # of the same steps bit-identical (embedding and scatter backward otherwise add with atomics, in any order;
    # SDPA picks deterministic attention kernels), and refuse cuBLAS calls without this workspace setting.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise pytest.UsageError(f"ATOLL_TEST_DEVICE=cuda, but torch {torch.__version__} ({build}) sees no CUDA device")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True  # and no per-run benchmarking among cuDNN's algorithms either
    torch.backends.cudnn.benchmark = False
    # fp32 matmuls in full fp32, as on the CPU (TF32 would round their inputs to 10 mantissa bits). cuDNN's own
    # TF32 setting is left alone: it is for convolutions and RNNs, which atoll's models do not have.
    torch.set_float32_matmul_precision("highest")


@pytest.hookimpl(tryfirst=True)  # registered after pytest's own ``-m`` hook, so it runs before it deselects
def pytest_collection_modifyitems(config, items):
    """Mark every test that takes ``device_name`` ``device``: ``-m device`` selects exactly the device tests."""
    for item in items:
        if "device_name" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


@pytest.fixture
def device_name() -> str:
    """The device this test trains on: ``ATOLL_TEST_DEVICE`` (``cpu`` or ``cuda``)."""
    return selected_device()


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


# ---- what each test costs --------------------------------------------------------------------------------------
_DURATIONS: dict[str, float] = {}
_BUSY: dict[str, float] = {}
DURATIONS_FILE = ROOT / "build" / "test-durations.json"


def _cpu_ticks() -> tuple[int, int]:
    """The machine's (busy, total) CPU ticks so far, all cores (``/proc/stat``; zeros where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields) - idle, sum(fields)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """How busy the machine's cores were while a test ran (set-up to tear-down): a test that leaves them idle
    waits rather than computes, and could share the machine with another (``build/test-durations.json``)."""
    busy0, total0 = _cpu_ticks()
    yield
    busy1, total1 = _cpu_ticks()
    if total1 > total0:
        _BUSY[item.nodeid] = (busy1 - busy0) / (total1 - total0)


def pytest_runtest_logreport(report):
    """Sum each test's set-up, call and tear-down seconds (a module fixture's swarm counts in its first test)."""
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Record every test's seconds of this session in ``build/test-durations.json``, slowest first, merged into the
    record of earlier sessions (``make test`` runs the suite in two sessions: the main venv's and xla's)."""
    import json

    if not _DURATIONS or hasattr(session.config, "workerinput"):  # an xdist worker: its controller writes it
        return
    kept, busy = {}, {}
    try:
        record = json.loads(DURATIONS_FILE.read_text())
        kept, busy = record["seconds"], record.get("cpu_busy", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    kept.update({k: round(v, 2) for k, v in _DURATIONS.items()})
    busy.update({k: round(v, 2) for k, v in _BUSY.items()})
    DURATIONS_FILE.parent.mkdir(parents=True, exist_ok=True)
    ordered = dict(sorted(kept.items(), key=lambda kv: -kv[1]))
    DURATIONS_FILE.write_text(json.dumps({
        "total_seconds": round(sum(ordered.values()), 1), "seconds": ordered,
        # The fraction of all cores busy while each test ran (this machine's load, not the test's alone).
        "cpu_busy": {k: busy[k] for k in ordered if k in busy},
    }, indent=1) + "\n")
