"""Time-bounded DHT reads and writes.

hivemind's ``DHT.get`` future is completed by a callback that runs when the value is found. A value that does
not deserialize (a msgpack ext type a hostile writer stored) makes that callback raise, and the future then
never completes: an unbounded ``await`` on it hangs its caller for good (one malformed value stopped every
round of a run). Every DHT read and write atoll makes goes through this module and gives up after ``timeout``
seconds; a read that gives up returns what an empty key would (``None``), a write reports failure. Callers
already treat both as "nothing there yet" and retry at their next poll.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from hivemind import DHT

logger = logging.getLogger("atoll")
READ_TIMEOUT = 10.0  # seconds; a healthy read takes well under a second on loopback and a few on a WAN
WRITE_TIMEOUT = 10.0


OnTimeout = Callable[[str], Any] | None  # hears "dht_read_timeout" or "dht_write_timeout" (a counter's kind)


async def get(dht: DHT, key: str, timeout: float | None = None, on_timeout: OnTimeout = None) -> Any:
    """``dht.get(key, latest=True)``, or None if it did not complete within ``timeout`` seconds (default
    ``READ_TIMEOUT``)."""
    timeout = READ_TIMEOUT if timeout is None else timeout
    try:
        return await asyncio.wait_for(_awaitable(dht.get(key, latest=True, return_future=True)), timeout)
    except asyncio.TimeoutError:
        _gave_up("read", key, timeout, on_timeout)
        return None


async def store(dht: DHT, key: str, value: Any, expiration_time: float, subkey: Any = None,
                timeout: float | None = None, on_timeout: OnTimeout = None) -> bool:
    """``dht.store(...)``: whether it was stored, False if it did not complete within ``timeout`` seconds (default
    ``WRITE_TIMEOUT``)."""
    timeout = WRITE_TIMEOUT if timeout is None else timeout
    try:
        return bool(await asyncio.wait_for(_awaitable(dht.store(key, value, expiration_time=expiration_time,
                                                                subkey=subkey, return_future=True)), timeout))
    except asyncio.TimeoutError:
        _gave_up("write", key, timeout, on_timeout)
        return False


def get_blocking(dht: DHT, key: str, timeout: float | None = None, on_timeout: OnTimeout = None) -> Any:
    """``get`` for code outside an event loop (start-up, ``atoll status``)."""
    timeout = READ_TIMEOUT if timeout is None else timeout
    try:
        return dht.get(key, latest=True, return_future=True).result(timeout)
    except (concurrent.futures.TimeoutError, TimeoutError):
        _gave_up("read", key, timeout, on_timeout)
        return None


def store_blocking(dht: DHT, key: str, value: Any, expiration_time: float, subkey: Any = None,
                   timeout: float | None = None, on_timeout: OnTimeout = None) -> bool:
    """``store`` for code outside an event loop."""
    timeout = WRITE_TIMEOUT if timeout is None else timeout
    try:
        return bool(dht.store(key, value, expiration_time=expiration_time, subkey=subkey,
                              return_future=True).result(timeout))
    except (concurrent.futures.TimeoutError, TimeoutError):
        _gave_up("write", key, timeout, on_timeout)
        return False


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
    # hivemind's MPFuture is awaitable but not a coroutine; wait_for needs something it can wrap in a task.
    return await future


def _gave_up(what: str, key: str, timeout: float, on_timeout: OnTimeout) -> None:
    logger.warning("DHT %s of %s gave up after %.0f s (no answer, or a value that does not deserialize)",
                   what, key, timeout)
    if on_timeout is not None:
        on_timeout(f"dht_{what}_timeout")
