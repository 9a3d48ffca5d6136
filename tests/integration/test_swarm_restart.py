"""The whole swarm stops and comes back from its checkpoints (maintenance, a power cut): it trains on as one swarm.

The founder comes back first (the others join through it) and, with nobody else training yet, its synchronous rounds
close alone at once. The others restore their checkpoints, catch up to it and register: every daemon must be back in
rounds with all the others, on one replica, and none may be left running a line of its own.
"""

import pytest
from support.swarms import MODELS_COMMON, assert_replicas_agree, peer_id, wait_for
from scripts.swarm import LocalSwarm

pytestmark = pytest.mark.integration

COMMON = ["--model", "nano", *MODELS_COMMON]
NAMES = "abc"


def full_rounds(swarm, name, after=0):
    """``name``'s rounds with every daemon as a member, from its ``after``-th round on."""
    return [r for r in swarm.daemons[name].rounds()[after:] if len(r["members"]) == len(NAMES)]


def test_a_swarm_restarted_from_checkpoints_trains_on_as_one(tmp_path):
    swarm = LocalSwarm(tmp_path, COMMON)
    try:
        swarm.start("a", join=False)
        for name in NAMES[1:]:
            swarm.start(name)
        wait_for(lambda: all(len(full_rounds(swarm, n)) >= 2 for n in NAMES), 180, "two full rounds on every daemon")
        codes = swarm.stop_all(timeout=60)
        assert all(codes[n] == 0 for n in NAMES), codes
        before = {n: len(swarm.daemons[n].rounds()) for n in NAMES}
        ids = {n: peer_id(swarm.daemons[n]) for n in NAMES}

        swarm.start("a", join=False)  # the founder first: the others join through it
        for name in NAMES[1:]:
            swarm.start(name)
        assert {n: peer_id(swarm.daemons[n]) for n in NAMES} == ids
        wait_for(lambda: all(len(full_rounds(swarm, n, before[n])) >= 3 for n in NAMES), 150,
                 "three full rounds on every daemon after the restart")
        assert_replicas_agree(swarm, NAMES)
        # One line: the last full round each daemon recorded is one the others recorded with the same result.
        last = {n: full_rounds(swarm, n, before[n])[-1] for n in NAMES}
        newest = min(r["version"] for r in last.values())
        hashes = {n: next(r["hash"] for r in full_rounds(swarm, n, before[n]) if r["version"] == newest)
                  for n in NAMES}
        assert len(set(hashes.values())) == 1, hashes
    finally:
        swarm.stop_all(timeout=30)
        for name, d in swarm.daemons.items():
            print(f"----- {name} -----\n{d.log()[-6000:]}")
