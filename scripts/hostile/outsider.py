"""An outsider's attacks on one live daemon: a peer with no join token, only a bare hivemind ``P2P``.

Each attack returns what it observed (a dict), so that tests and a later adversarial suite can assert on it.
``sample`` (optional) is called about every ``every`` seconds while an attack runs (to watch the victim's RSS or
open fds from outside); what it returns is kept in the result's ``samples``. Every P2P made here is shut down
(its p2pd child ended) before the function returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID

AGGREGATE = "AveragingServicer.rpc_aggregate"
DOWNLOAD = "StateServicer.rpc_download_state"
Sample = Callable[[], Any]

OPENING_AT_ONCE = 64  # idle_streams: streams being opened at once (refused ones close as others open)


def handler(run_id: str, method: str) -> str:
    """The protocol name hivemind registers ``method`` under for a run (``ServicerBase._get_handle_name``)."""
    return f"{run_id}::{method}"


@contextlib.asynccontextmanager
async def outsider(victim_maddr: str) -> AsyncIterator[P2P]:
    """A fresh identity (its own p2pd) that knows the victim's address; shut down on exit."""
    p2p = await P2P.create(initial_peers=[victim_maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield p2p
    finally:
        await p2p.shutdown()


async def _sampling(sample: Sample | None, every: float, into: list[Any]) -> None:
    while sample is not None:
        into.append(sample())
        await asyncio.sleep(every)


async def _with_samples(coro: Any, sample: Sample | None, every: float) -> tuple[Any, list[Any]]:
    samples: list[Any] = []
    sampler = asyncio.ensure_future(_sampling(sample, every, samples))
    try:
        return await coro, samples
    finally:
        sampler.cancel()
        if sample is not None:
            samples.append(sample())


async def oversized_frame(victim_maddr: str, victim: str, name: str, declared: int = 1 << 30,
                          send: int = 1 << 30, timeout: float = 60.0, sample: Sample | None = None,
                          every: float = 0.5) -> dict[str, Any]:
    """Open a stream to handler ``name``, declare a frame of ``declared`` bytes and send up to ``send`` of them.
    Returns how much was sent before the victim closed the stream (``closed_by_victim``) and how long it took."""

    async def attack(p2p: P2P) -> dict[str, Any]:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(victim), name)
        t0, sent, closed = time.monotonic(), 0, False
        chunk = bytes(1 << 20)
        try:
            writer.write(P2P.MESSAGE_MARKER + declared.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            while sent < send and time.monotonic() - t0 < timeout:
                if reader.at_eof():
                    closed = True
                    break
                writer.write(chunk[: min(len(chunk), send - sent)])
                await writer.drain()
                sent += min(len(chunk), send - sent)
            if not closed:  # everything sent: does the victim close it now?
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(reader.read(), 10.0)
                closed = reader.at_eof()
        except (ConnectionError, OSError):
            closed = True
        finally:
            writer.close()
        return {"declared": declared, "sent": sent, "closed_by_victim": closed, "seconds": time.monotonic() - t0}

    async with outsider(victim_maddr) as p2p:
        result, samples = await _with_samples(attack(p2p), sample, every)
    return {**result, "samples": samples}


async def idle_streams(victim_maddr: str, victim: str, name: str, count: int = 1400, hold: float = 15.0,
                       sample: Sample | None = None, every: float = 0.5) -> dict[str, Any]:
    """Open ``count`` streams to handler ``name`` from one identity and send nothing on them for ``hold`` seconds.
    Returns how many opened, how many the victim closed by then, and how many were still open."""

    async def attack(p2p: P2P) -> dict[str, Any]:
        peer, limit = PeerID.from_base58(victim), asyncio.Semaphore(OPENING_AT_ONCE)
        streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        failed = 0

        async def open_one() -> None:
            nonlocal failed
            async with limit:
                try:
                    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, name), 30.0)
                    streams.append((reader, writer))
                except Exception:
                    failed += 1

        t0 = time.monotonic()
        await asyncio.gather(*(open_one() for _ in range(count)))
        opened_in = time.monotonic() - t0
        await asyncio.sleep(hold)
        closed = sum(reader.at_eof() for reader, _ in streams)
        for _, writer in streams:
            writer.close()
        return {"requested": count, "opened": len(streams), "open_failed": failed, "closed_by_victim": closed,
                "still_open": len(streams) - closed, "opened_in_s": opened_in, "held_s": hold}

    async with outsider(victim_maddr) as p2p:
        result, samples = await _with_samples(attack(p2p), sample, every)
    return {**result, "samples": samples}


async def strangers_aggregate(victim_maddr: str, victim: str, run_id: str, identities: int = 8, per_identity: int = 8,
                              wait: float = 60.0, sample: Sample | None = None,
                              every: float = 0.5) -> dict[str, Any]:
    """Throwaway identities ask the victim to reduce shards of groups it never opened, each asking to wait
    ``wait`` seconds for them (the waiting slots of ``AveragingServicer``). Returns each call's outcome counted
    (``refused``: an error answer or a stream closed unanswered; ``held``: no answer after ``wait`` + 30 s;
    ``answered_ok``; ``open_failed:<error>``: it never reached the victim) and how long the longest took."""
    from atoll.protocols.reducer import AveragingServicer
    from atoll.protocols.wire import pack_request, unpack

    async def call(p2p: P2P) -> tuple[bool, float]:
        stub = AveragingServicer.get_stub(p2p, PeerID.from_base58(victim), namespace=run_id)
        header = {"group_id": secrets.token_hex(12), "weight": 1.0, "numel": 1024, "wait": wait, "norm": 1.0,
                  "codec": "none"}

        async def requests() -> AsyncIterator[Any]:
            yield pack_request(header)

        t0 = time.monotonic()
        try:
            stream = await stub.rpc_aggregate(requests())
        except Exception as e:  # never reached the victim's handler
            return f"open_failed:{type(e).__name__}", time.monotonic() - t0
        try:
            answer = await asyncio.wait_for(anext(stream), wait + 30.0)
            outcome = "answered_ok" if unpack(answer, {"ok": bool})["ok"] else "refused"
        except asyncio.TimeoutError:
            outcome = "held"  # still waiting: it holds a slot
        except Exception:  # StopAsyncIteration or a broken stream: the victim closed it unanswered
            outcome = "refused"
        return outcome, time.monotonic() - t0

    async def attack() -> dict[str, Any]:
        async with contextlib.AsyncExitStack() as stack:
            p2ps = [await stack.enter_async_context(outsider(victim_maddr)) for _ in range(identities)]
            outcomes = await asyncio.gather(*(call(p) for p in p2ps for _ in range(per_identity)))
        counts: dict[str, int] = {}
        for outcome, _ in outcomes:
            counts[outcome] = counts.get(outcome, 0) + 1
        return {"identities": identities, "calls": len(outcomes), "refused": counts.get("refused", 0),
                "outcomes": counts, "longest_s": max(s for _, s in outcomes), "asked_to_wait_s": wait}

    result, samples = await _with_samples(attack(), sample, every)
    return {**result, "samples": samples}
