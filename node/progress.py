"""Progress of long work in a daemon (a state download, a checkpoint's write or check): a rich bar on a terminal;
elsewhere (a log file, a service's journal) a log line every ``LOG_EVERY`` seconds and one at the end. Each says
bytes done of the total, the rate and the time left. Work that ends within ``QUIET_FOR`` seconds shows nothing:
small models' transfers stay as quiet as before."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable

from . import log

logger = logging.getLogger("atoll")

LOG_EVERY = 10.0  # seconds between two progress lines in a log
QUIET_FOR = 1.0  # seconds of work before a bar appears


class Meter:
    """Bytes done of a known ``total`` over the time since the meter began: the rate and the time left (pure; the
    clock is given)."""

    def __init__(self, total: int, now: float) -> None:
        if total <= 0:
            raise ValueError(f"total must be positive, got {total}")
        self.total, self.start, self.done, self.at = total, now, 0, now

    def update(self, done: int, now: float) -> None:
        self.done, self.at = min(max(done, 0), self.total), now

    def rate(self) -> float | None:
        """Bytes per second since the start; None before any time passed."""
        seconds = self.at - self.start
        return self.done / seconds if seconds > 0 else None

    def eta(self) -> float | None:
        """Seconds left at the rate so far; None while nothing is done."""
        rate = self.rate()
        return (self.total - self.done) / rate if rate else None

    def line(self) -> str:
        rate, eta = self.rate(), self.eta()
        return (f"{_mb(self.done)} of {_mb(self.total)} ({100 * self.done / self.total:.0f}%), "
                f"{'-' if rate is None else _mb(rate) + '/s'}, "
                f"{'-' if eta is None else f'{eta:.0f} s'} left")


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class Bars:
    """The terminal's progress bars: one rich display for every tracker drawn at once (rich allows one live display
    a console), started with the first bar and stopped with the last."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self._progress: Any = None
        self._tasks = 0
        self._lock = threading.Lock()

    def add(self, what: str, total: int) -> Any:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        with self._lock:
            if self._progress is None:
                # No redirection of stdout and stderr: log lines already print through the console, and a
                # daemon's stdout (its addresses, when piped) must stay its own.
                progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                    TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                                    transient=True, redirect_stdout=False, redirect_stderr=False)
                progress.start()
                self._progress = progress
            task = self._progress.add_task(what, total=total)
            self._tasks += 1  # counted once it is there: a failed add leaves no bar to wait for
            return task

    def update(self, task: Any, done: int, total: int | None = None) -> None:
        with self._lock:
            self._progress.update(task, completed=done, total=total)

    def remove(self, task: Any) -> None:
        with self._lock:
            self._progress.remove_task(task)
            self._tasks -= 1
            if not self._tasks:
                self._progress.stop()
                self._progress = None


_bars: Bars | None = None
_bars_lock = threading.Lock()


def _terminal_bars() -> Bars | None:
    """The terminal's one ``Bars`` (made once, whichever thread asks first: two would be two live displays)."""
    global _bars
    with _bars_lock:
        if log.terminal is None:
            return None
        if _bars is None or _bars.console is not log.terminal:
            _bars = Bars(log.terminal)
        return _bars


class Tracker:
    """One piece of work's progress (``track``): ``update(done)`` from any thread, ``close()`` at its end. None of
    its calls raises: they run inside the work (a state download, a checkpoint write), which a failing display
    must not fail; a display that fails is logged once and dropped for log lines."""

    def __init__(self, what: str, total: int, clock: Callable[[], float] = time.monotonic,
                 bars: Bars | None = None) -> None:
        self.what, self.clock = what, clock
        self.meter = Meter(total, clock())
        self.bars = bars  # the terminal's bars; None: log lines
        self._task: Any = None
        self._logged_at: float | None = None
        self._closed = False
        self._lock = threading.Lock()

    def update(self, done: int) -> None:
        self._safely(self._update, done)

    def resize(self, total: int) -> None:
        """The work's true size, once known (a file's size, header included, once written)."""
        self._safely(self._resize, total)

    def close(self, ok: bool = True) -> None:
        """The work ended (``ok``: it finished; else it failed or was given up). A last line if any was shown."""
        self._safely(self._close, ok)

    def _safely(self, call: Callable[[Any], None], arg: Any) -> None:
        try:
            call(arg)
        except Exception as e:  # noqa: BLE001 (see the class's docstring)
            with self._lock:
                if self.bars is None:
                    return
                logger.warning("%s: the progress bar failed (%r); progress goes to the log instead", self.what, e)
                if self._task is not None:
                    with contextlib.suppress(Exception):  # the shared display stops with its last bar
                        self.bars.remove(self._task)
                self.bars, self._task = None, None

    def _update(self, done: int) -> None:
        with self._lock:
            if self._closed:  # a late call from the work's thread after its end
                return
            now = self.clock()
            self.meter.update(done, now)
            if now - self.meter.start < QUIET_FOR:
                return
            if self.bars is not None:
                if self._task is None:
                    self._task = self.bars.add(self.what, self.meter.total)
                self.bars.update(self._task, self.meter.done)
            elif now - (self._logged_at if self._logged_at is not None else self.meter.start) >= LOG_EVERY:
                self._logged_at = now
                logger.info("%s: %s", self.what, self.meter.line())

    def _resize(self, total: int) -> None:
        with self._lock:
            self.meter.total = max(1, total)
            self.meter.update(self.meter.done, self.meter.at)
            if self._task is not None:
                self.bars.update(self._task, self.meter.done, total=self.meter.total)

    def _close(self, ok: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            shown = self._task is not None or self._logged_at is not None
            if self._task is not None:
                self.bars.remove(self._task)
                self._task = None
            if shown:
                m, seconds = self.meter, self.clock() - self.meter.start
                rate = f"{_mb(m.done / seconds)}/s" if seconds > 0 else "-"
                if ok:
                    logger.info("%s: done, %s in %.1f s (%s)", self.what, _mb(m.done), seconds, rate)
                else:
                    logger.info("%s: stopped after %.1f s at %s of %s (%s)", self.what, seconds, _mb(m.done),
                                _mb(m.total), rate)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.close(ok=kind is None)


def track(what: str, total: int) -> Tracker:
    """A tracker of ``total`` bytes of work named ``what``, drawn as a bar when the daemon logs to a terminal."""
    return Tracker(what, total, bars=_terminal_bars())
