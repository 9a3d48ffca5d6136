"""Lonely daemons: a swarm forked three ways, where no replica is vouched for by two peers, heals by vetting the
claims it cannot verify on its own held-out data, and a member's claim of a heavier replica that is the run's
initial model (of the trained model's norm: the gross filter lets it through) is refused by that check.

Three honest daemons each train on a side of their own (``split_side``) until step ``SPLIT``: three lines, each
merged alone. While they are apart, a member (``scripts/hostile/member.py``) on a's side claims a replica five
versions ahead of a's and serves Θ₀. a is lonely (no peer holds its replica; the member's claim vouches for
itself alone), downloads it, and its learner refuses it (``worse_state``). When the sides meet, every daemon is
lonely; the heaviest line passes the others' checks, and afterwards rounds span all three with identical replicas.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from swarm import LocalSwarm
from test_swarm import assert_replicas_agree, peer_id, wait_for

from atoll.protocols.auth import RunKey

pytestmark = pytest.mark.integration
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SPLIT = 300
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "10",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1",
          "--fault", "step_delay=0.1", "--fault", f"split_until={SPLIT}"]
HONEST = ("a", "b", "c")


REFUSED = "vouched for by nobody: its held-out loss is"  # the learner's log line when vetting refuses


def test_a_forked_swarm_heals_and_the_seed_model_is_refused(tmp_path):
    with LocalSwarm(tmp_path, COMMON) as swarm:
        for side, name in enumerate(HONEST):
            swarm.start(name, ["--fault", f"split_side={side}"], join=name != "a")
        a = swarm.daemons["a"]
        wait_for(lambda: len(a.rounds()) >= 3, 180, "a's first rounds")
        token = tmp_path / "hostile.token"
        RunKey.load(swarm.run_key).issue_token("atoll").save(token)
        result = tmp_path / "hostile.json"
        cmd = [sys.executable, str(SCRIPTS / "hostile" / "member.py"), "--initial-peers", *swarm.bootstrap,
               "--token", str(token), "--out", str(result), "--algorithm", "diloco", "--namespace", "atoll-side0",
               "seed_heavier=15"]
        with open(tmp_path / "hostile.log", "wb") as log:
            member = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert member.wait(180) == 0, (tmp_path / "hostile.log").read_text()[-3000:]
        finally:
            if member.poll() is None:
                os.killpg(member.pid, signal.SIGKILL)
        attack = json.loads(result.read_text())["seed_heavier"]
        assert attack["claims_published"] > 0
        wait_for(lambda: REFUSED in a.log(), 60, "a to refuse the seed model")
        ids = {peer_id(swarm.daemons[n]) for n in HONEST}

        def joint():
            return [r for r in a.rounds() if set(r["contributors"]) == ids]

        wait_for(lambda: len(joint()) >= 3, 300, "rounds of all three after the split")
        assert all(r["step"] >= SPLIT for r in joint())
        seed = set(attack["digests"])
        for name in HONEST:
            rounds = swarm.daemons[name].rounds()
            assert not seed & {r["hash"] for r in rounds}
            assert [r for r in rounds if r["step"] < SPLIT and len(r["contributors"]) == 1]  # it merged alone
        assert_replicas_agree(swarm, HONEST)
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
        summaries = [next(m for m in d.metrics() if m.get("event") == "summary") for d in swarm.daemons.values()]
        refused = summaries[0]["rejected_by_kind"]
        assert refused.get("worse_state", 0) >= 1
        assert "implausible_state" not in refused  # Θ₀ got past the gross filter: the vetting refused it
        assert sum(s["forks_healed"] for s in summaries) >= 2  # two of the three lines were given up
        held_out = [r["held_out_loss"] for r in joint()]
        assert held_out[-1] < 4.0  # a trained model, not the seed's (about 5.5)
