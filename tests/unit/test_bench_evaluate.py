"""The daemon benchmarks' final evaluation (scripts/benchkit.py ``evaluate_swarm``, used by the algorithms,
headline, WAN, straggler and chaos benchmarks): each daemon's checkpointed global replica, scattered into one
learner, on the same held-out batches. A stub checkpoint stands in for the daemons' (no processes)."""

import math
from types import SimpleNamespace

from scripts import benchkit
from scripts.benchkit import BATCH, EVAL_BATCHES, make_learner

from atoll.models.fragments import make_fragments
from atoll.node.config import RunConfig


def test_each_daemon_is_evaluated_on_its_own_replica(monkeypatch):
    run = RunConfig(model="nano", sync_every=8)
    learner, corpus = make_learner(run, shard=0)
    fragments = make_fragments(learner.params, run.num_fragments, run.sync_every, learner.model.embed.weight)
    theta0 = {f"replica.{f.index}.params": f.gather(learner.params).clone() for f in fragments}
    scaled = {k: v * 0.5 for k, v in theta0.items()}  # another replica: another loss
    checkpoints = {"a": theta0, "b": scaled}
    monkeypatch.setattr(benchkit, "load_checkpoint", lambda workdir: (checkpoints[workdir], {}))
    swarm = SimpleNamespace(daemons={"a": SimpleNamespace(workdir="a"), "b": SimpleNamespace(workdir="b")})
    losses = benchkit.evaluate_swarm(swarm, run)
    expected = learner.evaluate(corpus.held_out(EVAL_BATCHES, BATCH))  # θ₀ from the shared seed
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[0] == expected and losses[1] != expected
