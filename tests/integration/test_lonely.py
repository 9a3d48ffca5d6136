"""Lonely daemons: a swarm forked three ways, where no replica is vouched for by two peers, heals by vetting the
claims it cannot verify on its own held-out data, and a member's claim of a heavier replica that is the run's
initial model with its values shuffled (of the trained model's norm: the gross filter lets it through) is refused
by that check.

Three honest daemons each train on a side of their own (``split_side``) until step ``SPLIT``: three lines, each
merged alone. While they are apart, two members (``scripts/hostile/member.py``) join a's side: one claims a
replica at a's version that nobody holds and that loses every tie (a decoy), the other, once it sees the decoy, a replica five
versions ahead of a's, serving the shuffled Θ₀. a is lonely (neither of its two live peers holds its replica, nobody vouches
for the heavier claim), downloads it, and its learner refuses it (``worse_state``). (With the member alone on its
side, a would trust it: in a swarm smaller than ``--state-vouchers`` the other daemon is trusted; docs/security.md.)
When the sides meet, every daemon is lonely; the heaviest line passes the others' checks, and afterwards rounds
span all three with identical replicas.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import assert_replicas_agree, peer_id, wait_for

from atoll.protocols.auth import RunKey
from atoll.protocols.state_sync import MAX_ANCESTORS

pytestmark = [pytest.mark.integration, pytest.mark.waits]
ROOT = Path(__file__).resolve().parents[2]
SPLIT = 300
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "10",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1",
          "--harness", "step_delay=0.1", "--fault", f"split_until={SPLIT}"]
HONEST = ("a", "b", "c")


REFUSED = "vouched for by nobody: its held-out loss is"  # the learner's log line when vetting refuses


def test_a_forked_swarm_heals_and_a_scrambled_model_is_refused(tmp_path):
    with LocalSwarm(tmp_path, COMMON) as swarm:
        for side, name in enumerate(HONEST):
            # Three lines need three shards: two daemons reading one shard from one model train identically.
            swarm.start(name, ["--fault", f"split_side={side}", "--harness", f"data_shard={side}"], join=name != "a")
        a = swarm.daemons["a"]
        wait_for(lambda: len(a.rounds()) >= 3, 180, "a's first rounds")
        members = {}
        for name, attack in (("decoy", "decoy=25"), ("scrambled", "scrambled_heavier=15")):
            token = tmp_path / f"{name}.token"
            RunKey.load(swarm.run_key).issue_token("atoll").save(token)
            cmd = [sys.executable, "-m", "scripts.hostile.member", "--initial-peers", *swarm.bootstrap,
                   "--token", str(token), "--out", str(tmp_path / f"{name}.json"), "--algorithm", "diloco",
                   "--namespace", "atoll-side0", "--min-peers", "2", attack]
            with open(tmp_path / f"{name}.log", "wb") as log:
                members[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                 cwd=ROOT)
        try:
            for name, member in members.items():
                assert member.wait(180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        finally:
            for member in members.values():
                if member.poll() is None:
                    os.killpg(member.pid, signal.SIGKILL)
        attack = json.loads((tmp_path / "scrambled.json").read_text())["scrambled_heavier"]
        assert attack["claims_published"] > 0
        assert json.loads((tmp_path / "decoy.json").read_text())["decoy"]["claims_published"] > 0
        wait_for(lambda: REFUSED in a.log(), 60, "a to refuse the scrambled model")
        ids = {peer_id(swarm.daemons[n]) for n in HONEST}

        def joint():
            return [r for r in a.rounds() if set(r["contributors"]) == ids]

        wait_for(lambda: len(joint()) >= 3, 300, "rounds of all three after the split")
        assert all(r["step"] >= SPLIT for r in joint())
        scrambled = set(attack["digests"])
        for name in HONEST:
            rounds = swarm.daemons[name].rounds()
            assert not scrambled & {r["hash"] for r in rounds}
            assert [r for r in rounds if r["step"] < SPLIT and len(r["contributors"]) == 1]  # it merged alone
        assert_replicas_agree(swarm, HONEST)
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
        summaries = [next(m for m in d.metrics() if m.get("event") == "summary") for d in swarm.daemons.values()]
        refused = summaries[0]["rejected_by_kind"]
        assert refused.get("worse_state", 0) >= 1
        # worse_state: the scrambled state got past the gross filter and the held-out check refused it. Its norm
        # is twice Θ₀'s, so once a's replica has grown past four times that, the gross filter refuses it first
        # (implausible_state), as it should.
        # Two of the three lines were given up: two daemons adopted another line once the sides met. Such an
        # adoption is a fork healed, except that ancestry proves a fork only as far back as the new replica's
        # recorded history reaches (MAX_ANCESTORS versions): a daemon that reached the split that far behind the
        # others catches up to the line they share, uncounted (a CI run counted one fork healed, not two).
        adopted = {name: [m for m in swarm.daemons[name].metrics() if m.get("event") == "adopted"] for name in HONEST}
        gave_up = [name for name, events in adopted.items()
                   if any(m["forked"] or m["version"] - m["replaced"] >= MAX_ANCESTORS for m in events)]
        assert len(gave_up) >= 2, adopted
        forked = sum(m["forked"] for events in adopted.values() for m in events)
        assert sum(s["forks_healed"] for s in summaries) >= forked >= 1  # the counter may hold one adopted as it stopped
        held_out = [r["held_out_loss"] for r in joint()]
        assert held_out[-1] < 4.0  # a trained model, not a scrambled one (about 5.5)
