"""Nudges over hivemind's real p2p on 127.0.0.1: a member's nudge wakes the listener of its key at once, a
stranger's wakes nobody, and a nudge to a peer that is gone costs the teller nothing but a failed answer."""

import asyncio

from hivemind.p2p import P2P

from atoll.protocols.nudges import Nudges, NudgeServicer, tell
from atoll.protocols.stats import TrafficStats


async def exchange():
    receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await receiver.get_visible_maddrs())
    stranger = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=await receiver.get_visible_maddrs())
    gone = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    gone_id = gone.peer_id.to_base58()
    await gone.shutdown()
    try:
        nudges, stats = Nudges(), TrafficStats()
        servicer = NudgeServicer(nudges, known=lambda peer: peer == member.peer_id.to_base58(), stats=stats)
        await servicer.add_p2p_handlers(receiver, namespace="run")
        to = [receiver.peer_id.to_base58()]
        with nudges.listen(["run_round_0_3_D"]) as listener:
            from_stranger = await tell(stranger, "run", to, "run_round_0_3_D")
            stranger_woke = await listener.wait(1.0)
            from_member = await tell(member, "run", to, "run_round_0_3_D")
            member_woke = await listener.wait(10.0)
        to_gone = await tell(member, "run", [gone_id], "run_round_0_3_D", timeout=3.0)
        return from_stranger, stranger_woke, from_member, member_woke, to_gone, servicer.received, stats.rejected
    finally:
        for p2p in (receiver, member, stranger):
            await p2p.shutdown()


def test_a_members_nudge_wakes_the_listener_and_a_strangers_does_not():
    from_stranger, stranger_woke, from_member, member_woke, to_gone, received, rejected = asyncio.run(exchange())
    assert from_stranger == 1 and not stranger_woke  # answered (refused), nobody woken
    assert from_member == 1 and member_woke and received == 1
    assert to_gone == 0  # no answer, no exception
    assert rejected == 0  # a stranger's nudge is no offence: a joiner may not be in our table yet
