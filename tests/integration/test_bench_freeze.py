"""The freeze benchmark (scripts/bench_freeze.py) at short times: a daemon stopped with SIGSTOP for 10 s comes
back without merging a round alone and is in a shared round again; the JSON it writes holds every figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.waits]
ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_frozen_daemon_comes_back_without_lone_rounds(tmp_path):
    # 40 s after the thaw (it was 90): a freeze that lands while the frozen daemon reduces a shard of a round held
    # that round up for its other members for 2 round timeouts + 10 s before #33; a reducer still out once the others
    # answered now costs a grace of seconds and is left out, and the resumed daemon catches up from what they merged.
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_freeze", "--model", "nano", "--warmup", "20",
                           "--freeze", "10", "--after", "40", "--out", str(tmp_path)],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    doc = json.loads((tmp_path / "bench_freeze.json").read_text())
    (run,) = doc["runs"]
    # The freeze's aftermath is its first 30 s: later, on this loaded machine, a lone round (and the fork it makes)
    # happens to any daemon now and then, frozen or not.
    assert run["rounds_alone_early"] == 0 and run["adoptions_forked_early"] == 0, run
    assert run["rounds_after"] >= 1 and run["first_shared_round_after_s"] is not None, run
    assert 1 <= run["swarm_rounds_with_it"] <= run["swarm_rounds_after"], run
    assert set(run["steps_at_end"]) == {"a", "b", "frozen"}
    assert doc["summary"]["rounds_alone_early"]["mean"] == 0
