"""hivemind's ``DHTNode`` on an event loop in a thread of this process: the DHT handle of the light commands
(``node/ops/reader.py``) and, with ``--dht-in-process``, of a daemon.

hivemind's ``DHT`` forks a process for its node and talks to it through a pipe and torch's shared-memory futures;
functions given to its ``run_coroutine`` are pickled into that process. ``LocalDHT`` offers the same calls atoll
makes of a DHT handle (``protocols/dht_io.py``, the syncer, the member), on a node in this process: no fork, no
second copy of the process's pages, and no pickling (``run_coroutine(fn)`` runs ``fn(handle, node)`` on the node's
loop, as hivemind's DHT process does, so ``near``'s reads and ``dht_guard``'s counters apply unchanged). The cost is
the GIL: the node's work (record validation, msgpack) shares this process's interpreter with whatever else runs in
it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("atoll")
SHUTDOWN_TIMEOUT = 10.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # hivemind's DHT process runs on uvloop too
    except ImportError:  # pragma: no cover - a hivemind dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LocalDHT:
    """A started DHT node in this process (``create``); the subset of ``hivemind.DHT``'s interface atoll uses."""

    runs_near = True  # protocols/dht_io.py: this handle runs near's coroutines on a hivemind DHTNode

    def __init__(self) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="atoll-dht", daemon=True)
        self._thread.start()
        self.node: Any = None

    @classmethod
    def create(cls, initial_peers: Sequence[str], validators: list, client_mode: bool = False,
               **node_options: Any) -> LocalDHT:
        """Create the node (its p2pd, with ``node_options`` such as ``host_maddrs``, ``announce_maddrs``,
        ``identity_path``, ``startup_timeout``) and bootstrap from ``initial_peers``; raises what hivemind raises,
        having stopped what it started."""
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator

        dht = cls()
        try:
            dht.node = dht._submit(DHTNode.create(
                initial_peers=list(initial_peers), client_mode=client_mode,
                record_validator=CompositeValidator(validators), **node_options)).result()
        except BaseException:
            dht.shutdown()
            raise
        return dht

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def peer_id(self) -> Any:
        return self.node.peer_id

    def get_visible_maddrs(self) -> list:
        return self._submit(self.node.p2p.get_visible_maddrs()).result()

    async def replicate_p2p(self) -> Any:
        """A P2P handle on this node's p2pd for the caller's own event loop (as ``hivemind.DHT.replicate_p2p``)."""
        from hivemind.p2p import P2P

        return await P2P.replicate(self.node.p2p.daemon_listen_maddr)

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
        """Stop the node (and its p2pd), its background tasks and the loop's thread; safe to call twice."""
        if self._loop.is_closed():
            return
        if self.node is not None:
            try:
                self._submit(self.node.shutdown()).result(SHUTDOWN_TIMEOUT)
            except Exception as e:  # a node half started or already gone: its p2pd ends with this process
                logger.debug("DHT shutdown: %r", e)
        try:  # hivemind's background tasks (its routing table's refresh, sleeping): ended, not destroyed
            self._submit(_cancel_others()).result(SHUTDOWN_TIMEOUT)
        except Exception as e:
            logger.debug("DHT shutdown: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SHUTDOWN_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()


async def _cancel_others() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
