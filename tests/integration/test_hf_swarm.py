"""A Hugging Face ``transformers`` model in a live swarm (``--model hf:PATH``, the extra ``atoll[hf]``): three
daemons train a tiny ``LlamaForCausalLM`` built from a config.json (byte-level built-in corpus, nothing downloaded)
with identical replicas and falling held-out loss; a restarted daemon restores it, model and optimizer, from its
checkpoint and merges again; a daemon whose config.json builds other parameters refuses to join with one line; a
missing config is one line, exit 2."""

import json
import subprocess
import sys

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import MODELS_COMMON as COMMON
from support.swarms import (assert_held_out_falls, assert_refused_in_one_line, assert_replicas_agree, held_out_losses,
                        resumes_and_merges_again, stop_after_a_checkpoint, wait_for_shared_rounds)

pytest.importorskip("transformers")

from atoll.models.registry import build_model
from atoll.node.home.checkpoint import load_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.waits]
TINY = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def test_a_hugging_face_llama_swarm_trains_and_restarts(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the daemons inherit it: the hub is never asked
    config = tmp_path / "tiny-llama" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY))
    name = f"hf:{config}"
    model, shape = build_model(name, 0)
    params = list(model.parameters())
    assert (shape.vocab_size, shape.seq_len) == (256, 32)
    with LocalSwarm(tmp_path / "swarm", COMMON + ["--model", name]) as swarm:
        for n in "abc":
            swarm.start(n, join=n != "a")
        wait_for_shared_rounds(swarm, "abc", 4)
        assert_replicas_agree(swarm, "abc")
        assert_held_out_falls(swarm, "abc", founder="a")
        # c restarts from its checkpoint: it holds the HF model's parameters and their AdamW moments.
        step = stop_after_a_checkpoint(swarm, "c")
        tensors, meta = load_checkpoint(swarm.daemons["c"].workdir)
        assert meta["step"] == step
        assert [tuple(tensors[f"model.{i}"].shape) for i in range(len(params))] == [tuple(p.shape) for p in params]
        assert f"model.{len(params)}" not in tensors
        for i in range(len(params)):
            assert tensors[f"opt.{i}.exp_avg"].shape == params[i].shape
            assert float(tensors[f"opt.{i}.exp_avg_sq"].abs().sum()) > 0
        untrained = held_out_losses(swarm.daemons["a"])[0]  # the founder's first figure: near Θ₀'s
        merged = resumes_and_merges_again(swarm, "c", step)
        after = [r["held_out_loss"] for r in merged if r["held_out_loss"] is not None]
        assert not after or after[-1] < untrained, (untrained, after)  # not back at Θ₀
        # Another config.json under the same path on d's machine (here: rewritten): other shapes, refused.
        config.write_text(json.dumps(dict(TINY, hidden_size=48)))
        assert_refused_in_one_line(swarm.start("d"), "digest", "other than the run's")
        codes = {n: swarm.stop(n) for n in "abc"}
        assert all(code == 0 for code in codes.values()), codes


def test_a_missing_hf_config_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    out = subprocess.run([sys.executable, "-m", "atoll.node.cli", "start", "--model", f"hf:{missing}",
                          "--checkpoint-dir", str(tmp_path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--open"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-2000:]
    message = f"model: 'hf:{missing}': no such file or directory"
    assert len([line for line in out.stderr.splitlines() if message in line]) == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
