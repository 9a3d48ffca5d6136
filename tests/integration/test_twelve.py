"""Twelve daemons on this machine (#17): every one merges full rounds with the others on one replica, and
``atoll status`` lists every one of them.

The steps are slowed (``--harness step_delay``) so that twelve training loops leave this 2-core machine's CPUs to
the protocol: unthrottled, twelve nano models each take a core, and rounds time out for want of CPU, not for
anything the protocol does. DiLoCo's rounds wait for every live peer, so a round that all twelve merged is one
replica on all twelve."""

import concurrent.futures
import json
import subprocess
import sys

import pytest
from scripts.swarm import LocalSwarm, peer_id, wait_for
from support.swarms import assert_replicas_agree

pytestmark = pytest.mark.integration

COUNT = 12
NAMES = [f"d{i:02d}" for i in range(COUNT)]
COMMON = ["--model", "nano", "--batch-size", "2", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "20", "--round-timeout", "20", "--heartbeat", "2",
          "--harness", "step_delay=0.1"]


def full_rounds(daemon):
    return [r for r in daemon.rounds() if len(r["members"]) == COUNT]


@pytest.mark.timeout(900)
def test_twelve_daemons_train_one_replica_and_status_lists_them(tmp_path):
    swarm = LocalSwarm(tmp_path, COMMON)
    try:
        swarm.start(NAMES[0], join=False)
        # The eleven others at once, as a flash crowd joins: started one by one, each waiting for the one before to
        # print its addresses, they took over three minutes here.
        with concurrent.futures.ThreadPoolExecutor(len(NAMES) - 1) as pool:
            list(pool.map(swarm.start, NAMES[1:]))
        wait_for(lambda: all(len(full_rounds(swarm.daemons[n])) >= 2 for n in NAMES), 360,
                 f"two {COUNT}-member rounds on every daemon")
        assert_replicas_agree(swarm, NAMES)
        # The same rounds, by version, ended on the same replica on all twelve.
        by_version: dict[int, set[str]] = {}
        for name in NAMES:
            for r in full_rounds(swarm.daemons[name]):
                by_version.setdefault(r["version"], set()).add(r["hash"])
        assert by_version and all(len(hashes) == 1 for hashes in by_version.values()), by_version

        out = subprocess.run(
            [sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *swarm.bootstrap, "--json"],
            # A fresh process on a machine twelve daemons saturate: about 80 s here (5-6 s on an idle one).
            capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        listed = {p["peer_id"]: p for p in doc["peers"]}
        assert {peer_id(swarm.daemons[n]) for n in NAMES} <= set(listed), (sorted(listed), doc["summary"])
        for name in NAMES:
            p = listed[peer_id(swarm.daemons[name])]
            assert p["status"] == "training" and p["version"] >= 2 and p["tokens"] > 0, (name, p)
        assert doc["totals"]["peers"] == COUNT, doc["totals"]
    finally:
        swarm.stop_all(timeout=30)
        for name, d in swarm.daemons.items():
            print(f"----- {name} -----\n{d.log()[-1500:]}")
