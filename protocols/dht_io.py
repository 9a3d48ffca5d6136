"""Time-bounded DHT reads and writes.

hivemind's ``DHT.get`` future is completed by a callback that runs when the value is found. A value that does
not deserialize (a msgpack ext type a hostile writer stored) makes that callback raise, and the future then
never completes: an unbounded ``await`` on it hangs its caller for good (one malformed value stopped every
round of a run). Every DHT read and write atoll makes goes through this module and gives up after ``timeout``
seconds; a read that gives up returns what an empty key would (``None``), a write reports failure. Callers
already treat both as "nothing there yet" and retry at their next poll.

``CALLS`` counts them by operation and record kind (``key_kind``), with their time, the value bytes they carried
(``value_bytes``: what a write stored, what a read returned) and, for reads, the entries (subkeys) returned: what
the protocol asks of the DHT, for ``scripts/bench_scale.py``, the daemon's summary and its metrics. The bytes are
the records' own, once: a write's replicas, the walks' other answers and the wire's framing come on top.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import re
import threading
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from hivemind import DHT

from .near import get_near, store_near

logger = logging.getLogger("atoll")
READ_TIMEOUT = 10.0  # seconds; a healthy read takes well under a second on loopback and a few on a WAN
WRITE_TIMEOUT = 10.0


OnTimeout = Callable[[str], Any] | None  # hears "dht_read_timeout" or "dht_write_timeout" (a counter's kind)
_ROUND = re.compile(r"_round_\d+_\d+(_\w+)?$")
_PROGRESS = re.compile(r"_progress(_\d+)?$")
_OPEN = re.compile(r"_open_\d+_\d+_\w*$")


def key_kind(key: str) -> str:
    """The kind of record a key holds (``records.py``'s key functions): progress, open, head, config, revoked,
    summary, round or group; "other" for any other key."""
    if _PROGRESS.search(key) is not None:
        return "progress"
    if _OPEN.search(key) is not None:
        return "open"
    for kind in ("head", "config", "revoked", "summary"):
        if key.endswith("_" + kind):
            return kind
    if _ROUND.search(key) is None:
        return "other"
    return "group" if key.endswith("_group") else "round"


@dataclass
class CallStats:
    calls: int = 0
    seconds: float = 0.0
    entries: int = 0  # reads: subkeys (or 1 for a plain value) returned
    gave_up: int = 0
    bytes: int = 0  # value bytes written, or returned by reads (``value_bytes``)

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "seconds": round(self.seconds, 3), "entries": self.entries,
                "gave_up": self.gave_up, "bytes": self.bytes}


CALLS: dict[str, CallStats] = {}  # "get progress", "store round", ...: this process's calls
_calls_lock = threading.Lock()  # the event loop's calls and the blocking ones of start-up and ``atoll status``


def _entries(value: Any) -> int:
    inner = getattr(value, "value", None)  # a ValueWithExpiration: a dict of subkeys, or one value
    return 0 if value is None else len(inner) if isinstance(inner, dict) else 1


def _size(value: Any) -> int:
    """msgpack's length of ``value`` (hivemind's serializer differs only in a few bytes of ext types for tuples;
    it imports torch, which the light client must not); a value msgpack cannot pack counts as its ``repr``."""
    return len(msgpack.packb(value, use_bin_type=True, default=repr))


def value_bytes(value: Any) -> int:
    """The bytes of what a read returned (a ``ValueWithExpiration`` of one value, or of a dictionary of subkeys to
    ``ValueWithExpiration``s; None: 0), or of a value to write: each subkey and value packed once."""
    if value is None:
        return 0
    inner = getattr(value, "value", value)
    if isinstance(inner, dict):
        return sum(_size(k) + _size(getattr(v, "value", v)) for k, v in inner.items())
    return _size(inner)


def _written(value: Any, subkey: Any) -> int:
    """The bytes a write stores: its value, and its subkey where it has one (counted whether or not it completed:
    it went out)."""
    return _size(value) + (0 if subkey is None else _size(subkey))


def _count(op: str, key: str, started: float, value: Any = None, gave_up: bool = False,
           entries: int | None = None, size: int | None = None) -> None:
    entries = (_entries(value) if op == "get" else 0) if entries is None else entries
    size = value_bytes(value) if size is None else size
    with _calls_lock:
        stats = CALLS.setdefault(f"{op} {key_kind(key)}", CallStats())
        stats.calls += 1
        stats.seconds += time.monotonic() - started
        stats.gave_up += gave_up
        stats.entries += entries
        stats.bytes += size


def calls_summary() -> dict[str, dict[str, Any]]:
    """``CALLS`` as plain data, sorted by name."""
    with _calls_lock:
        return {name: CALLS[name].as_dict() for name in sorted(CALLS)}


async def get(dht: DHT, key: str, timeout: float | None = None, on_timeout: OnTimeout = None) -> Any:
    """The latest value under ``key`` (``near``: from the nodes nearest it in a small swarm), or None if the read
    did not complete within ``timeout`` seconds (default ``READ_TIMEOUT``)."""
    timeout, started = READ_TIMEOUT if timeout is None else timeout, time.monotonic()
    try:
        value = await asyncio.wait_for(_awaitable(_get(dht, key)), timeout)
    except asyncio.TimeoutError:
        _count("get", key, started, gave_up=True)
        _gave_up("read", key, timeout, on_timeout)
        return None
    _count("get", key, started, value)
    return value


async def store(dht: DHT, key: str, value: Any, expiration_time: float, subkey: Any = None,
                timeout: float | None = None, on_timeout: OnTimeout = None) -> bool:
    """Store ``value`` under ``key`` (``near``: straight to the nearest known nodes in a small swarm): whether it
    was stored, False if it did not complete within ``timeout`` seconds (default ``WRITE_TIMEOUT``)."""
    timeout, started = WRITE_TIMEOUT if timeout is None else timeout, time.monotonic()
    try:
        stored = bool(await asyncio.wait_for(_awaitable(_store(dht, key, value, expiration_time, subkey)), timeout))
    except asyncio.TimeoutError:
        _count("store", key, started, gave_up=True, size=_written(value, subkey))
        _gave_up("write", key, timeout, on_timeout)
        return False
    _count("store", key, started, size=_written(value, subkey))
    return stored


def _store(dht: Any, key: str, value: Any, expiration_time: float, subkey: Any) -> Any:
    """The write's future. hivemind's DHT runs ``near``'s in its process; another handle (the simulator's, a
    test's) is asked for its own ``store``."""
    if runs_near(dht):
        return dht.run_coroutine(functools.partial(store_near, key, subkey, value, expiration_time),
                                 return_future=True)
    return dht.store(key, value, expiration_time=expiration_time, subkey=subkey, return_future=True)


async def get_many(dht: DHT, keys: list[str], timeout: float | None = None,
                   on_timeout: OnTimeout = None) -> dict[str, Any]:
    """The latest value of each of ``keys`` (None where there is none), found in one traversal of the DHT (hivemind
    asks each node for several keys at once); ``{}`` if it did not complete within ``timeout`` seconds. Counted as
    one call, of the first key's kind, with the entries of all."""
    timeout, started = READ_TIMEOUT if timeout is None else timeout, time.monotonic()
    try:
        found = await asyncio.wait_for(_awaitable(_get_many(dht, tuple(keys))), timeout)
    except asyncio.TimeoutError:
        _count("get", keys[0], started, gave_up=True)
        _gave_up("read", f"{keys[0]} and {len(keys) - 1} more keys", timeout, on_timeout)
        return {}
    _count("get", keys[0], started, entries=sum(map(_entries, found.values())),
           size=sum(map(value_bytes, found.values())))
    return found


def get_many_blocking(dht: DHT, keys: list[str], timeout: float | None = None,
                      on_timeout: OnTimeout = None) -> dict[str, Any]:
    """``get_many`` for code outside an event loop."""
    timeout, started = READ_TIMEOUT if timeout is None else timeout, time.monotonic()
    try:
        found = _get_many(dht, tuple(keys)).result(timeout)
    except (concurrent.futures.TimeoutError, TimeoutError):
        _count("get", keys[0], started, gave_up=True)
        _gave_up("read", f"{keys[0]} and {len(keys) - 1} more keys", timeout, on_timeout)
        return {}
    _count("get", keys[0], started, entries=sum(map(_entries, found.values())),
           size=sum(map(value_bytes, found.values())))
    return found


def runs_near(dht: Any) -> bool:
    """Whether ``dht`` runs a hivemind ``DHTNode`` that ``near``'s coroutines may be given (``run_coroutine``):
    hivemind's DHT, or a handle that says it does (``local_dht.LocalDHT``). hivemind's DHT is not imported here:
    a process that never imported it holds none (``light_import``'s readers)."""
    hivemind_dht = sys.modules.get("hivemind.dht.dht")
    return getattr(dht, "runs_near", False) is True or (hivemind_dht is not None and isinstance(dht, hivemind_dht.DHT))


def _get(dht: Any, key: str) -> Any:
    """The latest value's future (see ``_store``)."""
    if runs_near(dht):
        return dht.run_coroutine(functools.partial(_get_one, key), return_future=True)
    return dht.get(key, latest=True, return_future=True)


def _get_many(dht: Any, keys: tuple[str, ...]) -> Any:
    """The future of the latest value of each of ``keys`` (see ``_store``)."""
    if runs_near(dht):
        return dht.run_coroutine(functools.partial(get_near, keys), return_future=True)
    return dht.run_coroutine(functools.partial(_latest, keys), return_future=True)


async def _get_one(key: str, dht: Any, node: Any) -> Any:
    return (await get_near((key,), dht, node))[key]


async def _latest(keys: tuple[str, ...], _dht: Any, node: Any) -> dict[str, Any]:
    return dict(await node.get_many(keys, sufficient_expiration_time=float("inf")))


def get_blocking(dht: DHT, key: str, timeout: float | None = None, on_timeout: OnTimeout = None) -> Any:
    """``get`` for code outside an event loop (start-up, ``atoll status``)."""
    timeout, started = READ_TIMEOUT if timeout is None else timeout, time.monotonic()
    try:
        value = _get(dht, key).result(timeout)
    except (concurrent.futures.TimeoutError, TimeoutError):
        _count("get", key, started, gave_up=True)
        _gave_up("read", key, timeout, on_timeout)
        return None
    _count("get", key, started, value)
    return value


def store_blocking(dht: DHT, key: str, value: Any, expiration_time: float, subkey: Any = None,
                   timeout: float | None = None, on_timeout: OnTimeout = None) -> bool:
    """``store`` for code outside an event loop."""
    timeout, started = WRITE_TIMEOUT if timeout is None else timeout, time.monotonic()
    try:
        stored = bool(_store(dht, key, value, expiration_time, subkey).result(timeout))
    except (concurrent.futures.TimeoutError, TimeoutError):
        _count("store", key, started, gave_up=True, size=_written(value, subkey))
        _gave_up("write", key, timeout, on_timeout)
        return False
    _count("store", key, started, size=_written(value, subkey))
    return stored


async def run_in_dht(dht: DHT, fn: Callable, timeout: float | None = None, on_timeout: OnTimeout = None) -> Any:
    """``dht.run_coroutine(fn)`` (``fn(dht, node)`` runs in the DHT's process: it must pickle), or None if it did
    not complete within ``timeout`` seconds (default ``READ_TIMEOUT``)."""
    timeout = READ_TIMEOUT if timeout is None else timeout
    try:
        return await asyncio.wait_for(_awaitable(dht.run_coroutine(fn, return_future=True)), timeout)
    except asyncio.TimeoutError:
        _gave_up("call", getattr(fn, "__name__", "a function"), timeout, on_timeout)
        return None


async def _awaitable(future: Any) -> Any:
    # hivemind's MPFuture is awaitable but not a coroutine; wait_for needs something it can wrap in a task. A
    # LocalDHT's is a concurrent future of another thread's loop.
    if not hasattr(future, "__await__"):
        return await asyncio.wrap_future(future)
    return await future


def _gave_up(what: str, key: str, timeout: float, on_timeout: OnTimeout) -> None:
    logger.warning("DHT %s of %s gave up after %.0f s (no answer, or a value that does not deserialize)",
                   what, key, timeout)
    if on_timeout is not None:
        on_timeout(f"dht_{what}_timeout")
