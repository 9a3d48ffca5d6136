"""The DHT client of the commands that only read or write a few records (``atoll status``, ``atoll dashboard``,
``atoll revoke``): hivemind's ``DHTNode`` in this process, on an event loop in a thread of its own.

A daemon runs hivemind's ``DHT``, which forks a process for its node and talks to it through pipes and torch's
shared-memory futures; a reader has no training loop to keep apart from the network, so it pays for neither: no
fork, no torch (with ``protocols/light_import.py`` installed first). It offers what ``protocols/dht_io.py`` asks of
a DHT handle: ``run_coroutine(fn, return_future=True)`` (``fn(handle, node)`` runs on the node's loop, as in
hivemind's DHT process, so ``protocols/near.py``'s reads apply), ``get``, ``store`` and ``shutdown``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from atoll.protocols.dht_setup import DHT_NODE_OPTIONS, apply_p2pd_environment

from ..checks import ConfigError, check_maddr, check_run_id

logger = logging.getLogger("atoll")
STARTUP_TIMEOUT = 30.0  # seconds for p2pd to start and one initial peer to answer, as a daemon's DHT start
BOOTSTRAP_RETRIES = 3  # NodeConfig's default
SHUTDOWN_TIMEOUT = 10.0


class Reader:
    """A client DHT node in this process (it serves nothing and no routing table keeps it). Use ``open_reader``."""

    runs_near = True  # protocols/dht_io.py: this handle runs near's coroutines on a hivemind DHTNode

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="atoll-dht-reader", daemon=True)
        self._thread.start()
        self.node: Any = None

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def start(self, initial_peers: Sequence[str], validators: list) -> None:
        """Create the node (its p2pd) and bootstrap from ``initial_peers``; raises what hivemind raises."""
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator

        self.node = self._submit(DHTNode.create(
            initial_peers=list(initial_peers), client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validator=CompositeValidator(validators), startup_timeout=STARTUP_TIMEOUT, **DHT_NODE_OPTIONS,
        )).result()

    def run_coroutine(self, fn: Callable, return_future: bool = False) -> Any:
        """``fn(self, node)`` on the node's loop: its result, or with ``return_future`` a concurrent future of it."""
        future = self._submit(fn(self, self.node))
        return future if return_future else future.result()

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        future = self._submit(self.node.get(key, latest=latest, **kwargs))
        return future if return_future else future.result()

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False,
              **kwargs: Any) -> Any:
        future = self._submit(self.node.store(key, value, expiration_time, subkey=subkey, **kwargs))
        return future if return_future else future.result()

    def shutdown(self) -> None:
        """Stop the node (and its p2pd) and the loop's thread; safe to call twice."""
        if not self._loop.is_closed():
            if self.node is not None:
                try:
                    self._submit(self.node.shutdown()).result(SHUTDOWN_TIMEOUT)
                except Exception as e:  # a node half started or already gone: its p2pd ends with this process
                    logger.debug("DHT reader shutdown: %r", e)
            try:  # hivemind's background tasks (its routing table's refresh, sleeping): ended, not destroyed
                self._submit(_cancel_others()).result(SHUTDOWN_TIMEOUT)
            except Exception as e:
                logger.debug("DHT reader shutdown: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(SHUTDOWN_TIMEOUT)
            if not self._thread.is_alive():
                self._loop.close()


async def _cancel_others() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def check_target(run_id: str, initial_peers: Sequence[str]) -> None:
    """``ConfigError`` (one line) for a bad run id or initial peer address."""
    check_run_id(run_id)
    if not initial_peers:
        raise ConfigError("initial_peers: give the multiaddr of a daemon of the run (one that `atoll start` printed)")
    for addr in initial_peers:
        check_maddr("initial_peers", addr, need_peer_id=True)


def open_reader(run_id: str, initial_peers: Sequence[str], validators: list,
                retries: int = BOOTSTRAP_RETRIES) -> Reader:
    """A started ``Reader`` of run ``run_id`` through ``initial_peers``; ``ConfigError`` (one line) for a bad run id or
    address (``check_target``), or when no initial peer answers after ``retries`` tries (2 s, then 4 s, ... apart, as
    a daemon's)."""
    check_target(run_id, initial_peers)
    apply_p2pd_environment()
    last_error: Exception | None = None
    for attempt in range(retries):
        reader = Reader()
        try:
            reader.start(initial_peers, validators)
            return reader
        except Exception as e:  # hivemind raises plain Exceptions for bootstrap failures
            last_error = e
            reader.shutdown()
            if attempt + 1 < retries:
                logger.warning("DHT start failed (%s); retrying in %d s", e, 2 * (attempt + 1))
                time.sleep(2 * (attempt + 1))
    raise ConfigError(f"initial_peers: could not reach any bootstrap peer after {retries} attempts ({last_error})")
