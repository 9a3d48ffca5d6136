"""Progress bars for the benchmarks and the chaos script: rich, on a terminal only (off one, the scripts' own
printed lines are the record, and nothing is added to them). One display a process, shared by every bar open at
once (rich allows one live display a console; the chaos script's two swarms run in two threads), with what the
scripts print meanwhile shown above the bars.

    for seed in each(args.seeds, "seeds"):
        ...
    with bar("chaos window", duration, unit="s") as progress:
        progress.update(elapsed)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_display: Any = None
_open = 0


class Bar:
    """One bar of a shared display: ``advance(n)`` or ``update(done)``; a no-op off a terminal."""

    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, done: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done)


@contextlib.contextmanager
def bar(description: str, total: float | None, unit: str = "") -> Iterator[Bar]:
    """A bar of ``total`` (runs, seconds, ...; None: unknown) while the block runs."""
    global _display, _open
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with _lock:
        if _display is None:
            console = Console()
            if console.is_terminal:
                _display = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("left"),
                                    TimeRemainingColumn(), console=console, transient=True)
                _display.start()
        progress = _display
        if progress is not None:
            _open += 1
            task = progress.add_task(description, total=total, unit=unit)
    if progress is None:  # not a terminal
        yield Bar(None, None)
        return
    try:
        yield Bar(progress, task)
    finally:
        with _lock:
            progress.remove_task(task)
            _open -= 1
            if not _open:
                progress.stop()
                _display = None


def each(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """``items``, one at a time, with a bar that counts them (``total``: their number, when ``items`` has no
    ``len``)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    with bar(description, total if total is not None else len(items)) as progress:  # type: ignore[arg-type]
        for item in items:
            yield item
            progress.advance()
