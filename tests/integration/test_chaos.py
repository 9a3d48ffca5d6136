"""A short deterministic chaos scenario on decoupled DiLoCo: a daemon dies in the middle of writing a checkpoint and
restarts from its previous good one, a daemon is frozen for several rounds, a new daemon joins, one leaves
gracefully. Every fault is keyed to observable progress (a fault flag, or waiting for rounds), never to a sleep.
Throughout, every live unfrozen daemon keeps training; at the end the survivors hold one replica.
"""

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import assert_replicas_agree, events, last_step, peer_id, wait_for

pytestmark = pytest.mark.integration

COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "40",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--harness", "step_delay=0.03"]
KILL_CHECKPOINT = 3


def final_replica(d):
    """(versions, ancestors) per fragment from a daemon's newest checkpoint (written when it left)."""
    meta = json.loads(sorted(d.workdir.glob("ckpt-*.json"))[-1].read_text())
    return meta["versions"], meta["ancestors"]


def digest_at(versions, ancestors, p, version):
    """The digest fragment ``p`` had at ``version``: the ancestors list ends with the current version's."""
    back = versions[p] - version
    return ancestors[p][-1 - back] if 0 <= back < len(ancestors[p]) else None


def replica_now(d):
    """{fragment: (version, hash)} of a daemon's replica after its newest round or adoption."""
    out = {}
    for m in d.metrics():
        if m.get("event") in ("round", "adopted"):
            out[m["fragment"]] = (m["version"], m["hash"])
    return out


class Progress:
    """No survivor stalls: after each fault, every daemon expected to train must advance ``STEPS`` inner steps past
    where it was when the fault hit, and meanwhile no two of its step records (one every 10 steps, about 0.5 s apart
    here), nor the phase's start and its first record, may lie more than ``MAX_GAP`` seconds apart."""

    STEPS = 20
    MAX_GAP = 10.0

    def __init__(self, swarm):
        self.swarm, self.last = swarm, {}

    def advance(self, names, phase, timeout=90):
        started = time.time()
        since = {n: last_step(self.swarm.daemons[n]) for n in names}
        try:
            wait_for(lambda: all(last_step(self.swarm.daemons[n]) >= since[n] + self.STEPS for n in names), timeout,
                     f"{names} to train {self.STEPS} steps during {phase}")
        except AssertionError:
            now = {n: last_step(self.swarm.daemons[n]) for n in names}
            raise AssertionError(f"a daemon stalled during {phase}: steps {since} -> {now}") from None
        for n in names:
            times = [started] + [m["time"] for m in self.swarm.daemons[n].metrics()
                                 if "step" in m and "event" not in m and m["time"] >= started]
            gap = max(b - a for a, b in zip(times, times[1:]))
            assert gap <= self.MAX_GAP, f"{n} stalled for {gap:.1f} s during {phase}"


def test_kill_mid_checkpoint_freeze_join_leave(tmp_path):
    with LocalSwarm(tmp_path, COMMON) as swarm:
        swarm.start("a", join=False)
        with ThreadPoolExecutor(3) as pool:  # start-up is the slow part: the others start together
            list(pool.map(lambda args: swarm.start(*args),
                          [("b",), ("c", ["--fault", f"kill_in_checkpoint={KILL_CHECKPOINT}"]), ("d",)]))
        a, b, c = (swarm.daemons[n] for n in "abc")
        progress = Progress(swarm)
        wait_for(lambda: all(last_step(swarm.daemons[n]) >= 10 for n in "abd"), 180, "every daemon to train")

        # 1. c dies in the middle of its third checkpoint; it restarts from the second, then catches up.
        wait_for(lambda: not c.alive(), 240, "c to die in the middle of a checkpoint")
        assert c.proc.returncode == -9
        assert f"killing this daemon in the middle of checkpoint {KILL_CHECKPOINT}" in c.log()
        leftovers = sorted(c.workdir.glob("ckpt-*.safetensors.tmp"))
        assert leftovers, "the half-written checkpoint should be on disk"
        good = events(c, "checkpoint")
        assert len(good) == KILL_CHECKPOINT - 1
        merged_before = {}  # per fragment, the newest round c merged with peers before it died
        for r in c.rounds():
            if len(r["contributors"]) >= 2:
                merged_before[r["fragment"]] = max(merged_before.get(r["fragment"], 0), r["version"])
        progress.advance("abd", "c's crash")
        c = swarm.start("c")
        line = wait_for(lambda: re.search(r"resumed from checkpoint: version (\d+), step (\d+)",
                                          c.log().split("middle of checkpoint")[-1]), 120, "c to resume")
        assert (int(line[1]), int(line[2])) == (good[-1]["version"], good[-1]["step"])
        me = peer_id(c)
        restarted_at = len(c.rounds())
        wait_for(lambda: [r for r in c.rounds()[restarted_at:] if me in r["contributors"]
                          and len(r["contributors"]) >= 2], 180, "c to contribute to a shared round again")
        # Nothing c had merged with its peers before the crash is lost: every fragment it merges again is past
        # those versions (the rounds merged after its last checkpoint came back by download before it trained).
        # Only its own work since the checkpoint is gone (including rounds it merged alone).
        after = {}
        for r in c.rounds()[restarted_at:]:
            after.setdefault(r["fragment"], r["version"])
        assert after and all(v > merged_before.get(p, 0) for p, v in after.items()), (merged_before, after)
        progress.advance("abcd", "c's restart")
        wait_for(lambda: len(events(c, "checkpoint")) > len(good), 120, "c to write a checkpoint again")
        # The next checkpoint write removed the leftover (a newer .tmp may be a checkpoint being written now).
        assert not [p for p in leftovers if p.exists()], leftovers

        # 2. b is frozen (SIGSTOP: daemon, DHT process and p2pd) while a merges several rounds.
        swarm.signal("b", signal.SIGSTOP)
        frozen_at = last_step(b)
        try:
            rounds = len(a.rounds())
            progress.advance("acd", "b's freeze")
            wait_for(lambda: len(a.rounds()) >= rounds + 8, 180, "a to merge 8 rounds while b is frozen")
            assert last_step(b) == frozen_at
        finally:
            swarm.signal("b", signal.SIGCONT)
        adopted = len(events(b, "adopted"))

        # 3. A new daemon joins: every fragment at once, spread over the donors holding the newest replica.
        e = swarm.start("e")
        wait_for(lambda: len(events(b, "adopted")) > adopted, 120, "b to download the fragments it missed")
        joined = wait_for(lambda: events(e, "joined"), 120, "e to join")[0]
        # A fragment's donors are those of the join's last pass: a fragment downloaded in a first pass, whose
        # newest holder still held that very replica when a second pass came (another fragment had failed), lists
        # none (catchup's held replica), so only fragments that list donors count towards the spread.
        assert len(joined["donors"]) == 4 and len({ds[-1] for ds in joined["donors"] if ds}) >= 2, joined
        wait_for(lambda: any(peer_id(e) in r["contributors"] and len(r["contributors"]) >= 2 for r in e.rounds()),
                 180, "e to contribute to a shared round")
        progress.advance("abcde", "e's join")

        # 4. d leaves gracefully; the others keep merging without it.
        assert swarm.stop("d") == 0
        assert events(swarm.daemons["d"], "summary")
        rounds = len(a.rounds())
        progress.advance("abce", "d's leave")
        wait_for(lambda: len(a.rounds()) >= rounds + 4, 120, "a to merge 4 rounds after d left")

        assert_replicas_agree(swarm, "abce")
        # The survivors converge on one replica: a moment comes when all four hold the same version and hash of
        # every fragment (each daemon's replica as its newest round or adoption left it).
        wait_for(lambda: len({json.dumps(replica_now(swarm.daemons[n]), sort_keys=True) for n in "abce"}) == 1, 120,
                 "the survivors to hold identical replicas")
        codes = swarm.stop_all(timeout=60)
        assert all(codes[n] == 0 for n in "abce"), codes
        # And they stopped on one history: at each fragment's oldest final version, every survivor's replica is the
        # same (a round may land on some between two SIGTERMs, so the final versions can differ by that round).
        finals = {n: final_replica(swarm.daemons[n]) for n in "abce"}
        for p in range(4):
            common = min(v[p] for v, _ in finals.values())
            at_common = {n: digest_at(v, anc, p, common) for n, (v, anc) in finals.items()}
            assert len(set(at_common.values())) == 1 and None not in at_common.values(), (p, common, at_common)
        for name, d in swarm.daemons.items():
            log = d.log()
            assert "Traceback" not in log, f"{name}: " + log[log.index("Traceback") - 300:][:3000]
