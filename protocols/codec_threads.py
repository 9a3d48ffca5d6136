"""The threads one ``encode`` or ``decode`` of a large payload may use (``codecs.py``): its blocks are independent,
so above ``PARALLEL_MIN`` values they are split into contiguous runs done by ``threads()`` worker threads at once
(torch's kernels release the GIL), byte for byte the same output as on one thread.

One run is one core's work: a single call's torch ops did not get faster with more intra-op threads here
(docs/results.md, "Islands of several ranks"), so the parallelism is ours. The setting is the process's.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

PARALLEL_MIN = 1 << 22  # values: below it a payload is one run, on the caller's thread
ROW = 256  # the values ``in_runs`` counts a row as, for the threshold
_threads = 1
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def set_threads(n: int) -> None:
    """How many threads one ``encode`` or ``decode`` of a large payload may use (1: the caller's thread alone)."""
    global _threads, _pool
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"codec threads must be a positive int, got {n!r}")
    if n != _threads and _pool is not None:
        _pool.shutdown(wait=False)
        _pool = None
    _threads = n


def threads() -> int:
    return _threads


def pooled() -> bool:
    """Whether a payload was ever split onto worker threads under the current setting."""
    return _pool is not None


def in_runs(rows: int, fn: Callable[[int, int], None]) -> None:
    """``fn(r0, r1)`` over contiguous runs of ``rows`` rows covering them all, on up to ``threads()`` threads."""
    global _pool
    runs = min(_threads, max(1, rows * ROW // PARALLEL_MIN))
    if runs == 1:
        fn(0, rows)
        return
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(_threads, thread_name_prefix="codec")
    edges = [rows * i // runs for i in range(runs + 1)]
    for future in [_pool.submit(fn, lo, hi) for lo, hi in zip(edges, edges[1:])]:
        future.result()
