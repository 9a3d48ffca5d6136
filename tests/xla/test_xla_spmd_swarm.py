"""A swarm of an SPMD island (``--device xla --spmd-devices 4``: one process, torch_xla's CPU runtime with four
devices, θ and AdamW sharded over them, bf16) and a CPU daemon (fp32) on 127.0.0.1: synchronous DiLoCo rounds
merge both contributions into identical replicas, the held-out loss goes down, the SPMD island compiles nothing
new once warm, and its progress record counts its four devices as ranks."""

import json
import os
import subprocess
import sys

import pytest
from scripts.swarm import LocalSwarm, peer_id, wait_for
from xla_helpers import xla_only

pytestmark = [xla_only, pytest.mark.integration]

COMMON = ["--model", "nano", "--batch-size", "2", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1"]
NAMES = ("s", "c")
COMPILED = "Compilation Cause"  # one per compiled graph in torch_xla's debug report


def full_rounds(d):
    return [r for r in d.rounds() if len(r["members"]) == 2]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PT_XLA_DEBUG_LEVEL", "1")  # only the xla daemon prints anything
        mp.delenv("CPU_NUM_DEVICES", raising=False)  # the SPMD daemon sets it from --spmd-devices
        s = LocalSwarm(tmp_path_factory.mktemp("xla-spmd-swarm"), COMMON)
        try:
            s.start("s", ["--device", "xla", "--spmd-devices", "4"], join=False)
            s.start("c", ["--device", "cpu", "--batch-size", "8"])  # the same 8 sequences per step as the island
            yield s
        finally:
            s.stop_all(timeout=30)
            for name, d in s.daemons.items():
                print(f"----- {name} -----\n{d.log()[-3000:]}")


def test_spmd_island_and_cpu_daemon_train_together(swarm):
    s, c = swarm.daemons["s"], swarm.daemons["c"]
    wait_for(lambda: all(len(full_rounds(swarm.daemons[n])) >= 3 for n in NAMES), 300,
             "three 2-member rounds on both daemons")
    compiled, seen = s.log().count(COMPILED), len(full_rounds(s))
    assert compiled > 0
    wait_for(lambda: len(full_rounds(s)) >= seen + 2, 180, "two more rounds on the SPMD island")
    assert s.log().count(COMPILED) == compiled  # rounds and steps compile nothing once warm
    by_version = [{r["version"]: r for r in full_rounds(swarm.daemons[n])} for n in NAMES]
    common = assert_identical_replicas(swarm, 4)
    for version in common:  # both contributed to every common round
        for rounds in by_version:
            if version in rounds:
                assert set(rounds[version]["contributors"]) == {peer_id(s), peer_id(c)}
    for name in NAMES:
        losses = {r["version"]: r["held_out_loss"] for r in full_rounds(swarm.daemons[name])}
        assert losses[common[-1]] < losses[common[0]] < 5.0


def assert_identical_replicas(swarm, min_rounds):
    """Every round version both daemons completed together ended with the same replica hash on each; returns
    those versions (waiting briefly for ``min_rounds``: each daemon writes its own record of a round)."""

    def common_versions():
        by_version = [{r["version"]: r for r in full_rounds(swarm.daemons[n])} for n in NAMES]
        common = sorted(set.intersection(*(set(v) for v in by_version)))
        return (by_version, common) if len(common) >= min_rounds else None

    by_version, common = wait_for(common_versions, 60, f"{min_rounds} rounds recorded by both")
    for version in common:
        hashes = {v[version]["hash"] for v in by_version}
        assert len(hashes) == 1, f"round v{version} ended with different replicas: {hashes}"
    return common


def test_status_counts_the_islands_devices_as_ranks(swarm):
    out = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *swarm.bootstrap, "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PT_XLA_DEBUG_LEVEL": "0"},
    )
    assert out.returncode == 0, out.stderr
    peers = {p["peer_id"]: p for p in json.loads(out.stdout)["peers"]}
    island, cpu = peers[peer_id(swarm.daemons["s"])], peers[peer_id(swarm.daemons["c"])]
    assert island["device"] == "xla:CPU/bf16/spmd4" and island["ranks"] == 4
    assert cpu["device"] == "cpu" and cpu["ranks"] == 1
