"""Once a daemon has begun leaving, its syncer starts no background task (no sockets here: the syncer is built
without its network, only the task bookkeeping is exercised)."""

import asyncio
import warnings
from types import SimpleNamespace

from atoll.node.syncer import Syncer


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
