"""A slow disk does not slow training: while a checkpoint is being written, rounds merge and steps go on, and the
next checkpoint is taken at the first step boundary after the write ends (not at every round, waiting for it)."""

import pytest
from scripts.swarm import LocalSwarm, wait_for

from atoll.node.home.checkpoint import load_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.waits]

SLOW = 4.0  # seconds each checkpoint write is held (``slow_checkpoint``)
SYNC_EVERY = 5


def test_training_goes_on_while_a_slow_checkpoint_is_written(tmp_path):
    args = ["--model", "nano", "--batch-size", "2", "--open", "--algorithm", "diloco", "--sync-every",
            str(SYNC_EVERY), "--harness", "step_delay=0.02", "--fault", f"slow_checkpoint={SLOW}"]
    with LocalSwarm(tmp_path, args) as swarm:
        d = swarm.start("a", join=False)
        wait_for(lambda: len([m for m in d.metrics() if m.get("event") == "checkpoint"]) >= 3, 180,
                 "three checkpoints")
        codes = swarm.stop_all(timeout=60)
    assert codes == {"a": 0}, d.log()[-2000:]
    metrics = d.metrics()
    checkpoints = [m for m in metrics if m.get("event") == "checkpoint"]
    rounds = [m for m in metrics if m.get("event") == "round"]
    # Every round came due for a checkpoint; those that came while a write was going were folded into the next.
    for before, after in zip(checkpoints, checkpoints[1:-1]):  # the last one is the leaving daemon's
        merged = [r for r in rounds if before["step"] < r["step"] <= after["step"]]
        assert len(merged) >= 3, (before, after, [r["step"] for r in merged])
    # The loop never waited for the disk: no gap between progress events as long as a write.
    steps = [m for m in metrics if "step" in m and "event" not in m]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    assert steps[-1]["step"] > 100 and max(gaps) < SLOW, max(gaps)
    _, meta = load_checkpoint(d.workdir)
    assert meta["step"] == next(m for m in metrics if m.get("event") == "summary")["step"]
