"""A daemon restarted on a checkpoint that does not fit its model (a tensor of another shape, its hash intact)
resumes from the older one with one log line; when none fits, it stops with one line and exit code 2, never a
traceback, and never trains on a model loaded in part."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from scripts.swarm import LocalSwarm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.waits]

ARGS = ["--model", "nano", "--batch-size", "2", "--open", "--algorithm", "diloco", "--sync-every", "5",
        "--harness", "step_delay=0.02"]


def misfit(json_path):
    """Rewrite a checkpoint pair so that one of the learner's tensors has another shape, with a hash that checks."""
    meta = json.loads(json_path.read_text())
    tensor_path = json_path.with_name(meta["tensors_file"])
    tensors = load_file(str(tensor_path))
    name = next(k for k in sorted(tensors) if not k.startswith(("replica.", "local.", "ef.")))
    tensors[name] = torch.zeros(3)
    save_file(tensors, str(tensor_path))
    meta["tensors_sha256"] = hashlib.sha256(tensor_path.read_bytes()).hexdigest()
    json_path.write_text(json.dumps(meta))
    return meta


def test_a_checkpoint_that_does_not_fit_falls_back_and_none_fitting_is_one_line(tmp_path):
    with LocalSwarm(tmp_path, ARGS) as swarm:
        d = swarm.start("a", join=False)
        wait_for(lambda: len([m for m in d.metrics() if m.get("event") == "checkpoint"]) >= 2, 180,
                 "two checkpoints")
        assert swarm.stop_all(timeout=60) == {"a": 0}
        older, newest = sorted(d.workdir.glob("ckpt-*.json"))[-2:]
        older_step = json.loads(older.read_text())["step"]
        misfit(newest)

        d = swarm.start("a", join=False)
        resumed = wait_for(lambda: [m for m in d.metrics() if m.get("event") == "resumed"][-1:], 120, "a resume")
        assert resumed[0]["step"] == older_step
        assert swarm.stop_all(timeout=60) == {"a": 0}
        log = d.log()
        assert "does not fit this model" in log and "Traceback" not in log

        for path in sorted(d.workdir.glob("ckpt-*.json")):
            misfit(path)
        try:
            swarm.start("a", join=False)
        except RuntimeError:  # it may stop before it prints its addresses
            pass
        d = swarm.daemons["a"]
        assert d.proc.wait(120) == 2
        last = d.log().strip().splitlines()[-1]
        assert "fits this model" in last and "Traceback" not in d.log(), d.log()[-2000:]
