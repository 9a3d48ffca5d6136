"""Once a daemon has begun leaving, its syncer starts no background task (no sockets here: the syncer is built
without its network, only the task bookkeeping is exercised)."""

import asyncio
import warnings
from types import SimpleNamespace

from atoll.node.rounds.syncer import Syncer


def bare_syncer() -> Syncer:
    syncer = Syncer.__new__(Syncer)
    syncer._tasks = set()
    syncer.ctx = SimpleNamespace(leaving=False)
    return syncer


def test_spawn_runs_tasks_until_leaving_then_starts_none():
    async def main():
        syncer = bare_syncer()
        ran = []

        async def work(tag):
            ran.append(tag)

        task = syncer._spawn(work("before"))
        assert task is not None and task in syncer._tasks
        await task
        assert not syncer._tasks  # the reference is dropped when it ends

        # A round cancelled by the leave spawns a publish from its ``finally``: it must not run after the DHT is
        # shut down, and must not leave a never-awaited coroutine behind.
        syncer.ctx.leaving = True
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited" would be a RuntimeWarning
            assert syncer._spawn(work("after")) is None
        await asyncio.sleep(0)
        assert ran == ["before"] and not syncer._tasks

    asyncio.run(main())


def test_a_leaving_syncer_serves_open_streams_first_within_a_bound(monkeypatch):
    import atoll.node.rounds.syncer as syncer_module
    from atoll.protocols.p2p_guard import StreamLimits

    monkeypatch.setattr(syncer_module, "LINGER", 4.0)
    monkeypatch.setattr(syncer_module, "LINGER_QUIET", 0.1)

    async def main():
        syncer = bare_syncer()
        syncer.guard = SimpleNamespace(limits=StreamLimits())
        loop = asyncio.get_running_loop()
        syncer.guard.limits.open_total = 1  # a member is still fetching our reduced shard
        loop.call_later(0.3, setattr, syncer.guard.limits, "open_total", 0)
        t0 = loop.time()
        await syncer._linger()
        assert 0.35 <= loop.time() - t0 < 3.5  # waited for the stream, then a quiet spell, not the whole bound
        syncer.guard.limits.open_total = 1  # a stream that never ends: the bound holds
        t0 = loop.time()
        await syncer._linger()
        assert 3.95 <= loop.time() - t0 < 8.0
        syncer.guard = None  # no P2P yet: nothing to wait for
        t0 = loop.time()
        await syncer._linger()
        assert loop.time() - t0 < 1.0

    asyncio.run(main())
