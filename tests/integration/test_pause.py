"""Lending the machine on a real swarm: a daemon paused by its operator (``atoll pause``) for several rounds frees
its model's memory and shows ``paused``; the others go on without waiting for it; resumed (``atoll resume``), it
catches up by replaying the rounds it missed and contributes again, with replicas identical to the others'. Then a
policy (``--pause-when file:PATH``) pauses and releases a daemon on its own, and ``--max-hours`` makes one leave
cleanly."""

import json
import subprocess
import sys

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import events
from support.swarms import last_step
from support.swarms import assert_replicas_agree, peer_id, resumes_and_merges_again, wait_for

pytestmark = pytest.mark.integration

COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "40",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--compression", "int4",
          "--harness", "step_delay=0.03"]


def atoll(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "atoll.node.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def status_of(swarm, name):
    out = atoll("status", "--initial-peers", *swarm.bootstrap, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    listed = {p["peer_id"]: p for p in json.loads(out.stdout)["peers"]}
    return listed.get(peer_id(swarm.daemons[name]), {}).get("status")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("pause"), COMMON)
    try:
        s.start("a", join=False)
        s.start("b")
        s.start("c", ["--pause-to", "checkpoint"])
        yield s
    finally:
        s.stop_all(timeout=30)
        for name, d in s.daemons.items():
            print(f"----- {name} -----\n{d.log()[-4000:]}")


def test_paused_daemon_frees_its_memory_while_the_others_go_on(swarm):
    a, b, c = (swarm.daemons[n] for n in "abc")
    me = peer_id(c)
    wait_for(lambda: any(me in r["contributors"] and len(r["contributors"]) >= 2 for r in c.rounds()), 240,
             "c to contribute to a shared round")
    out = atoll("pause", "--checkpoint-dir", str(c.workdir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("paused at step ") and "(operator)" in out.stdout, out.stdout
    [paused] = events(c, "paused")
    # Every byte of θ and AdamW's state left the trainee (to its checkpoint), and the checkpoint holds that step.
    assert paused["held_bytes"] == 0 and paused["freed_bytes"] > 0, paused
    assert paused["mode"] == "checkpoint" and paused["reasons"] == ["operator"]
    assert max(m["step"] for m in events(c, "checkpoint")) == paused["step"]

    # Several rounds go by without c: nobody waits for it, and it trains no step.
    start = {n: len(swarm.daemons[n].rounds()) for n in "ab"}
    steps = {n: last_step(swarm.daemons[n]) for n in "ab"}
    assert status_of(swarm, "c") == "paused"
    # Rounds counted from 3 s after the pause, once a and b read c's paused record (the rounds before may still
    # have waited for c): `atoll status` answers in under a second now, and 4 rounds could all fall before that.
    wait_for(lambda: all(len([r for r in swarm.daemons[n].rounds()[start[n]:] if r["time"] > paused["time"] + 3]) >= 4
                         and last_step(swarm.daemons[n]) >= steps[n] + 40 for n in "ab"), 240,
             "a and b to merge 4 rounds and train 40 steps each while c is paused")
    for n in "ab":
        d = swarm.daemons[n]
        later = [r for r in d.rounds()[start[n]:] if r["time"] > paused["time"] + 3]  # once our status was read
        assert later and all(me not in r["members"] for r in later), (n, later)
    assert last_step(c) <= paused["step"]
    assert not events(c, "resumed")


def test_resumed_daemon_catches_up_by_replay_and_contributes_again(swarm):
    c = swarm.daemons["c"]
    me = peer_id(c)
    before_rounds = len(c.rounds())
    out = atoll("resume", "--checkpoint-dir", str(c.workdir))
    assert out.returncode == 0 and out.stdout.startswith("training at step "), out.stdout + out.stderr
    [resumed] = events(c, "resumed")
    # The rounds c missed are in its peers' logs: it replays them instead of downloading Θ_p.
    adopted = wait_for(lambda: [m for m in events(c, "adopted") if m["time"] >= resumed["time"] - 5], 60,
                       "c to adopt the fragments it missed")
    assert any(m["replayed"] >= 1 for m in adopted), adopted
    wait_for(lambda: any(me in r["contributors"] and len(r["contributors"]) >= 2 for r in c.rounds()[before_rounds:]),
             240, "c to contribute to a shared round again")
    assert resumed["paused_seconds"] > 0
    wait_for(lambda: status_of(swarm, "c") == "training", 60, "atoll status to show c training")
    assert_replicas_agree(swarm, "abc")


def test_stopped_while_paused_it_leaves_with_its_state_and_resumes_from_it(swarm):
    """SIGTERM to a paused daemon (its θ in the checkpoint): it takes θ back, writes its last checkpoint at the
    paused step, exits 0; started again, it resumes from that step and merges with the others."""
    c = swarm.daemons["c"]
    out = atoll("pause", "--checkpoint-dir", str(c.workdir))
    assert out.returncode == 0, out.stdout + out.stderr
    step = events(c, "paused")[-1]["step"]
    assert swarm.stop("c") == 0, c.log()[-3000:]
    last = events(c, "checkpoint")[-1]
    assert last["step"] == step, last
    [summary] = events(c, "summary")
    assert summary["pauses"] == 2
    assert not (c.workdir / "control.sock").exists()
    resumes_and_merges_again(swarm, "c", step)


def test_a_file_policy_pauses_and_releases_and_max_hours_leaves(swarm):
    flag = swarm.root / "wanted"
    d = swarm.start("d", ["--pause-when", f"file:{flag}", "--resume-after", "1", "--max-hours", "0.0125"])
    me = peer_id(d)
    wait_for(lambda: last_step(d) >= 20, 120, "d to train")
    flag.touch()
    wait_for(lambda: events(d, "paused"), 60, "d to pause while the file exists")
    [paused] = events(d, "paused")
    assert paused["mode"] == "host" and paused["reasons"] == [f"file:{flag}"], paused
    flag.unlink()
    wait_for(lambda: events(d, "resumed"), 60, "d to resume once the file is gone")
    before = len(d.rounds())
    wait_for(lambda: any(me in r["contributors"] for r in d.rounds()[before:]), 120, "d to contribute again")
    # --max-hours 0.0125: 45 s after its start it leaves, as a SIGTERM would make it: checkpoint, exit 0. (Pausing,
    # resuming and contributing again took 13 s from its start in a run here, one at a time.)
    assert d.proc.wait(240) == 0, d.log()[-3000:]
    assert "contributed for the time given" in d.log()
    [summary] = events(d, "summary")
    assert summary["pauses"] == 1 and summary["paused_seconds"] > 0
    assert "Traceback" not in d.log()


def test_no_daemon_crashed(swarm):
    codes = swarm.stop_all(timeout=60)
    assert all(code == 0 for code in codes.values()), codes
    for name, d in swarm.daemons.items():
        assert "Traceback" not in d.log(), name
