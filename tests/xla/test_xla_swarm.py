"""A real mixed swarm on 127.0.0.1: one daemon on xla (torch_xla's CPU runtime, bf16 autocast) and two on the CPU
(fp32). They average into bit-identical replicas, the loss goes down, the xla daemon compiles nothing new once
warm (counted from torch_xla's own compilation report, ``PT_XLA_DEBUG_LEVEL=1``), and it restarts from its
checkpoint. One swarm is shared by the tests of this module, in order."""

import json
import os
import re
import subprocess
import sys

import pytest
from scripts.swarm import LocalSwarm, peer_id, wait_for
from xla_helpers import xla_only

pytestmark = [xla_only, pytest.mark.integration]

# Synchronous DiLoCo: every round waits for all three, so "the xla daemon is in every round" is a fair check.
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1"]
NAMES = ("x", "c1", "c2")
COMPILED = "Compilation Cause"  # one per compiled graph in torch_xla's debug report


def full_rounds(d):
    return [r for r in d.rounds() if len(r["members"]) == 3]


def assert_identical_replicas(swarm, names, min_rounds):
    """Every round version that all of ``names`` completed together ended with the same replica hash on each.
    Waits (briefly) for at least ``min_rounds`` such versions: each daemon writes its own record of a round."""

    def common_versions():
        by_version = [{r["version"]: r for r in full_rounds(swarm.daemons[n])} for n in names]
        common = sorted(set.intersection(*(set(v) for v in by_version)))
        return (by_version, common) if len(common) >= min_rounds else None

    by_version, common = wait_for(common_versions, 60, f"{min_rounds} rounds recorded by all of {names}")
    for version in common:
        hashes = {v[version]["hash"] for v in by_version}
        assert len(hashes) == 1, f"round v{version} ended with different replicas: {hashes}"
    return common


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PT_XLA_DEBUG_LEVEL", "1")  # inherited by the daemons; only the xla one prints anything
        s = LocalSwarm(tmp_path_factory.mktemp("xla-swarm"), COMMON)
        try:
            s.start("x", ["--device", "xla"], join=False)  # the xla daemon starts the run, the CPU ones join it
            s.start("c1", ["--device", "cpu"])
            s.start("c2", ["--device", "cpu"])
            yield s
        finally:
            s.stop_all(timeout=30)
            for name, d in s.daemons.items():
                print(f"----- {name} -----\n{d.log()[-3000:]}")


def test_xla_and_cpu_daemons_train_together(swarm):
    x = swarm.daemons["x"]
    wait_for(lambda: all(len(full_rounds(swarm.daemons[n])) >= 3 for n in NAMES), 300,
             "three 3-member rounds on every daemon")
    assert_identical_replicas(swarm, NAMES, 3)
    # Once warm, rounds (fragment to host, merged values back in place, held-out evaluation) compile nothing.
    compiled, seen = x.log().count(COMPILED), len(full_rounds(x))
    assert compiled > 0  # the report is really there
    wait_for(lambda: len(full_rounds(x)) >= seen + 2, 180, "two more rounds on the xla daemon")
    assert x.log().count(COMPILED) == compiled
    common = assert_identical_replicas(swarm, NAMES, 5)
    for name in NAMES:  # the held-out loss of the common replica goes down, as each daemon measures it
        by_version = {r["version"]: r["held_out_loss"] for r in full_rounds(swarm.daemons[name])}
        assert by_version[common[-1]] < by_version[common[0]] < 5.0


def test_status_shows_the_xla_daemon(swarm):
    out = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *swarm.bootstrap, "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PT_XLA_DEBUG_LEVEL": "0"},
    )
    assert out.returncode == 0, out.stderr
    devices = {p["peer_id"]: p["device"] for p in json.loads(out.stdout)["peers"]}
    assert devices[peer_id(swarm.daemons["x"])] == "xla:CPU/bf16"
    assert devices[peer_id(swarm.daemons["c1"])] == devices[peer_id(swarm.daemons["c2"])] == "cpu"


def test_xla_daemon_restarts_from_checkpoint(swarm):
    x = swarm.daemons["x"]
    assert swarm.stop("x") == 0
    meta = json.loads(sorted(x.workdir.glob("ckpt-*.json"))[-1].read_text())
    x2 = swarm.start("x", ["--device", "xla"], join=True)
    line = wait_for(lambda: re.search(r"resumed from checkpoint: version (\d+), step (\d+), data position (\d+)",
                                      x2.log().split("stopped at step")[-1]), 120, "x to resume")
    assert tuple(map(int, line.groups())) == (meta["version"], meta["step"], meta["position"])
    assert peer_id(x2) == meta["peer_id"]
    me = peer_id(x2)
    wait_for(lambda: any(r["version"] > meta["version"] + 1 and me in r["contributors"] for r in full_rounds(x2)),
             240, "x to contribute to 3-member rounds again")
    assert_identical_replicas(swarm, NAMES, 5)
    codes = swarm.stop_all(timeout=60)
    assert all(codes[n] == 0 for n in NAMES), codes
    # It went on from the saved step, not from 0: everything the restarted daemon recorded is past that step.
    events = x2.metrics()  # the file is appended to: the restarted daemon's events follow its "resumed" event
    start = max(i for i, m in enumerate(events) if m.get("event") == "resumed" and "position" in m)
    after = events[start + 1:]
    summary = [m for m in after if m.get("event") == "summary"]
    assert len(summary) == 1 and summary[0]["step"] > meta["step"], summary
    assert all(m["step"] > meta["step"] for m in after if "loss" in m and "event" not in m)
