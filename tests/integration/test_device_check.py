"""The accelerator check (scripts/device_check.py) as a dry run on the CPU: every section runs at tiny sizes and
reports what the GPU run reports, so that the check the GPU's few minutes go to cannot rot unnoticed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_device_check_dry_run_fills_every_section(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.device_check", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    doc = json.loads((tmp_path / "device_check.json").read_text())
    assert proc.returncode == 0, (proc.stdout[-2000:], json.dumps(doc, indent=1)[-4000:])
    sections = doc["sections"]
    assert set(sections) == {"correctness", "swarm", "overhead", "quality"}
    assert sections["correctness"]["collected"] >= 10  # the device-parametrised tests exist and are selected
    swarm = sections["swarm"]
    assert swarm["exit_codes"] == {"a": 0, "b": 0, "c": 0}
    assert swarm["shared_round_records_agreeing"] > 0 and swarm["shared_round_records_differing"] == 0
    assert all(row["rounds"] > 0 and row["tokens_per_s"] > 0 and row["blocked_s"] == 0 for row in swarm["daemons"])
    overhead = sections["overhead"]
    assert overhead["learner_vs_bare"]["rc"] == 0 and overhead["learner_vs_bare"]["result"]
    assert overhead["codec"]["rc"] == 0 and overhead["codec"]["result"]
    quality = sections["quality"]
    names = [r["config"]["name"] for r in quality["results"]]
    assert names == ["ddp", "decoupled-delta-k3", "diloco", "decoupled-overwrite-k3"]
    assert all(math.isfinite(r["held_out"]) and r["held_out"] < 5.5 for r in quality["results"])  # ln 256 ≈ 5.55
    assert len({r["tokens_per_learner"] for r in quality["results"]}) == 1  # equal tokens
    delta = quality["results"][1]["counters"]
    assert delta["carried"] > 0 and delta["lost"] == 0
