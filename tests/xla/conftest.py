"""The xla tests: torch_xla's real compiler and runtime on the CPU (``PJRT_DEVICE=CPU``).

They run in the xla environment (``make test-xla``); in an environment without torch_xla they are skipped with
that reason, unless ``ATOLL_REQUIRE_XLA=1`` (set by ``make test-xla``), which turns a missing torch_xla into
failures instead of skips.
"""

import os
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla starts its runtime, here and in daemons we start
# torch_xla's CPU runtime on one thread, like torch in the daemons: on a small machine shared by several daemons a
# multi-threaded step waits for its slowest thread.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

if os.environ.get("ATOLL_REQUIRE_XLA") == "1":  # make test-xla: the shared venv must run this clone's code
    import atoll.node
    import pytest

    _here = Path(__file__).resolve().parents[2] / "node"
    if Path(atoll.node.__file__).resolve().parent != _here:
        raise pytest.UsageError(f"atoll.node is imported from {atoll.node.__file__}, not from {_here}: "
                                "put build/xla-path on PYTHONPATH (make test-xla does)")
