"""A round with more members than ``--max-group`` is split into groups, and the groups' results are merged into one
replica (``RoundProtocol._merge_siblings``): four daemons with a cap of two end such rounds on one replica, with
every member's work in it, instead of one replica per group that adoption would reconcile by dropping one."""

import pytest
from scripts.swarm import LocalSwarm, peer_id, wait_for

pytestmark = pytest.mark.integration

COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "decoupled", "--fragments", "1", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--max-group", "2",
          "--quorum", "4"]
NAMES = "abcd"


def merged_rounds(swarm):
    """{(fragment, version): [(daemon, record)]} of rounds a daemon recorded with every daemon as a contributor."""
    out = {}
    for name in NAMES:
        for r in swarm.daemons[name].rounds():
            if len(r["contributors"]) == len(NAMES):
                out.setdefault((r["fragment"], r["version"]), []).append((name, r))
    return out


def test_a_split_round_ends_on_one_replica_with_every_members_work():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as root:
        swarm = LocalSwarm(Path(root), COMMON)
        try:
            swarm.start("a", join=False)
            for name in NAMES[1:]:
                swarm.start(name)
            # Rounds that every daemon recorded, in two groups of two, with all four as contributors.
            both = lambda: [k for k, recs in merged_rounds(swarm).items() if len(recs) == len(NAMES)]  # noqa: E731
            wait_for(lambda: len(both()) >= 2, 300, "two split rounds merged by all four daemons")
            peers = {peer_id(swarm.daemons[n]) for n in NAMES}
            for key in both():
                records = [r for _, r in merged_rounds(swarm)[key]]
                assert all(len(r["members"]) == 2 for r in records), records  # split: each ran its group of two
                groups = {tuple(sorted(r["members"])) for r in records}
                assert len(groups) == 2 and set().union(*groups) == peers, groups
                assert len({r["hash"] for r in records}) == 1, (key, [r["hash"] for r in records])
        finally:
            swarm.stop_all(timeout=30)
            for name, d in swarm.daemons.items():
                print(f"----- {name} -----\n{d.log()[-3000:]}")
