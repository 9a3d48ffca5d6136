"""A hostile reducer over real hivemind P2P daemons on loopback: one that answers with its shard ×(−5) under
honest scalars is refused by every member (``reducer_shard``, an offence), and one that never answers is left out
once the others have answered (``late_reducer``), an offender after ``LATE_OFFENCES`` rounds in a row; the
honest members never wait for the round's own bound (2 × the timeout + 10 s)."""

import asyncio
import time

import torch
from hivemind.p2p import P2P

from atoll.node.faults import ScaledAnswer, SilentAnswer
from atoll.protocols import averaging
from atoll.protocols.averaging import allreduce
from atoll.protocols.reducer import LATE_OFFENCES, AveragingServicer, GroupSpec
from atoll.protocols.stats import TrafficStats

TIMEOUT = 20.0


def _rounds(answer, rounds: int, same_group: bool = False):
    async def main():
        peers = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(3)]
        try:
            ids = [p.peer_id.to_base58() for p in peers]
            offences = {i: [] for i in ids}
            servicers = []
            for k, i in enumerate(ids):
                stats = TrafficStats()
                stats.on_offence = lambda peer, kind, i=i: offences[i].append((peer, kind))
                servicers.append(AveragingServicer("run", i, stats, clip_factor=4.0,
                                                   answer=answer if k == 2 else None))
                await servicers[k].add_p2p_handlers(peers[k], namespace="run")
            for a in range(3):
                for b in range(a + 1, 3):
                    await peers[a]._client.connect(peers[b].peer_id, peers[b]._visible_maddrs)
            gen = torch.Generator().manual_seed(0)
            base = torch.randn(3000, generator=gen)
            results, took = [], []
            for version in range(rounds):
                spec = GroupSpec("run", 0, 0 if same_group else version, 0, tuple(sorted(ids)), 3000, codec="int4", block=64,
                                 merge="trimmed")
                deltas = [base + 0.5 * torch.randn(3000, generator=gen) for _ in range(3)]
                started = time.monotonic()
                results.append(await asyncio.gather(*(allreduce(peers[k], servicers[k], spec, ids[k], deltas[k],
                                                                1.0, TIMEOUT) for k in range(3))))
                took.append(time.monotonic() - started)
            return ids, servicers, offences, results, took
        finally:
            for p in peers:
                await p.shutdown()

    return asyncio.run(main())


def test_a_reducer_answering_its_shard_times_minus_five_is_refused_and_an_offender():
    ids, servicers, offences, results, _ = _rounds(ScaledAnswer(), 1)
    hostile = ids[2]
    for k in (0, 1):
        assert results[0][k].merged is None and results[0][k].failed == [hostile]
        assert servicers[k].stats.rejected_by_kind.get("reducer_shard") == 1
        assert (hostile, "reducer_shard") in offences[ids[k]]


def test_a_reducer_that_never_answers_is_left_out_after_the_others_answered(monkeypatch):
    monkeypatch.setattr(averaging, "ANSWER_GRACE", 1.0)
    ids, servicers, offences, results, took = _rounds(SilentAnswer(), LATE_OFFENCES)
    hostile = ids[2]
    for k in (0, 1):
        assert all(r[k].merged is None and r[k].failed == [hostile] for r in results)
        assert servicers[k].stats.rejected_by_kind.get("late_reducer") == LATE_OFFENCES
        assert offences[ids[k]] == [(hostile, "late_reducer_offence")]  # the LATE_OFFENCES-th in a row, once
    assert max(took) < TIMEOUT  # not the round's own bound, 2 × TIMEOUT + 10 s


def test_a_round_formed_again_gets_the_first_result_from_honest_reducers():
    """Reducers remember a group (same version, members, attempt: same id) and answer with the result of the parts
    they got first: a member that contributes anew is answered with its earlier part in the header. That is no
    misstatement (before, every member held it against every honest reducer: ``reducer_parts``)."""
    ids, servicers, offences, results, _ = _rounds(None, 2, same_group=True)
    for k in range(3):
        assert results[1][k].merged is not None and torch.equal(results[1][k].merged, results[0][k].merged)
        assert servicers[k].stats.rejected == 0 and offences[ids[k]] == []
