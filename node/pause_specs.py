"""How an operator spells lending the machine, checked where the configuration is read: ``--pause-to``,
``--pause-when``, ``--schedule``, ``--until`` and ``--max-hours``. Parsing only: ``pause.py`` samples the policies
these name, and the island carries a pause out. Depends on nothing in atoll, so the configuration depends on no
feature module."""

from __future__ import annotations

import datetime as dt
import enum
import re
import time
from collections.abc import Callable


class Mode(enum.StrEnum):
    """Where a paused daemon keeps θ and the inner optimizer's state while the accelerator is free."""

    HOST = "host"  # a copy in host memory: back on the device in the time of one transfer
    CHECKPOINT = "checkpoint"  # its checkpoint on disk: the host's memory is free too; read back on resume


class PolicyError(ValueError):
    pass


def parse_window(text: str) -> tuple[dt.time, dt.time]:
    """``HH:MM-HH:MM`` as (start, end); ``PolicyError`` for anything else or an empty window."""
    m = re.fullmatch(r"\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*", text)
    if not m:
        raise PolicyError(f"expected HH:MM-HH:MM (e.g. 22:00-06:00), got {text!r}")
    h1, m1, h2, m2 = map(int, m.groups())
    if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
        raise PolicyError(f"{text!r} is not a time of day")
    start, end = dt.time(h1, m1), dt.time(h2, m2)
    if start == end:
        raise PolicyError(f"{text!r} is an empty window")
    return start, end


def check_spec(spec: str) -> None:
    """``PolicyError`` unless ``spec`` is a ``--pause-when`` policy (``busy``, ``busy:CORES``, ``file:PATH``)."""
    kind, sep, arg = spec.partition(":")
    if kind == "busy":
        if sep:
            try:
                cores = float(arg)
            except ValueError:
                raise PolicyError(f"busy:{arg}: CORES must be a number") from None
            if not 0 < cores < 1e6:
                raise PolicyError(f"busy:{arg}: CORES must be positive")
        return
    if kind == "file" and arg:
        return
    raise PolicyError(f"unknown policy {spec!r}; use busy, busy:CORES or file:PATH")


def deadline_of(max_hours: float, until: str, now: dt.datetime | None = None,
                monotonic: Callable[[], float] = time.monotonic) -> float | None:
    """The monotonic time at which a daemon given ``--max-hours``/``--until`` leaves (the earlier of the two);
    None for neither. ``until``: an ISO date and time, or HH:MM (its next occurrence, local time)."""
    now = now or dt.datetime.now()
    ends: list[float] = []
    if max_hours:
        ends.append(max_hours * 3600)
    if until:
        at = parse_until(until, now)
        ends.append((at - now).total_seconds())
    return monotonic() + max(0.0, min(ends)) if ends else None


def parse_until(text: str, now: dt.datetime) -> dt.datetime:
    """``--until``: an ISO date and time (local unless it names a zone), or HH:MM today or, once passed, tomorrow."""
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if m:
        h, mi = int(m.group(1)), int(m.group(2))
        if h > 23 or mi > 59:
            raise PolicyError(f"{text!r} is not a time of day")
        at = now.replace(hour=h, minute=mi, second=0, microsecond=0)
        return at if at > now else at + dt.timedelta(days=1)
    try:
        at = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise PolicyError(f"expected an ISO date and time (2026-12-05T06:00) or HH:MM, got {text!r}") from None
    if at.tzinfo is not None:
        at = at.astimezone().replace(tzinfo=None)
    if at <= now:
        raise PolicyError(f"{text} has passed")
    return at
