"""Models other than the built-in GPT in a live swarm: the Llama-style preset trains in three daemons with
identical replicas and falling held-out loss, and a restarted daemon restores it; a user's own model from a
factory (``--model package.module:factory``) trains too, and a daemon whose factory builds other parameters
refuses to join with one line (exit 2); a bad factory path is one line, exit 2."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from swarm import LocalSwarm
from test_swarm import assert_replicas_agree, peer_id, wait_for

pytestmark = pytest.mark.integration
# Synchronous DiLoCo: every round waits for every live daemon, so "3-member rounds" holds on a loaded machine too
# (decoupled at H=10 merged mostly alone there; the model is what these tests are about, not the algorithm).
COMMON = ["--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1",
          "--fault", "step_delay=0.05"]


def shared_rounds(d, n):
    return [r for r in d.rounds() if len(r["members"]) == n]


def test_a_llama_swarm_trains_and_restarts(tmp_path):
    with LocalSwarm(tmp_path, COMMON + ["--model", "llama-nano"]) as swarm:
        for name in "abc":
            swarm.start(name, join=name != "a")
        wait_for(lambda: all(len(shared_rounds(swarm.daemons[n], 3)) >= 4 for n in "abc"), 240,
                 "four 3-member rounds on every daemon")
        assert_replicas_agree(swarm, "abc")
        for name in "abc":
            losses = [r["held_out_loss"] for r in swarm.daemons[name].rounds() if r["held_out_loss"] is not None]
            assert len(losses) >= 4 and losses[-1] < losses[0] < 6.0
        # c restarts from its checkpoint: its Llama and its AdamW state come back, and it merges again.
        c = swarm.daemons["c"]
        wait_for(lambda: list(c.workdir.glob("ckpt-*.json")), 120, "c to write a checkpoint")
        assert swarm.stop("c") == 0
        c = swarm.start("c")
        wait_for(lambda: re.search(r"resumed from checkpoint", c.log().split("stopped at step")[-1]), 120,
                 "c to resume")
        me = peer_id(c)
        before = len(c.rounds())
        wait_for(lambda: [r for r in c.rounds()[before:] if me in r["contributors"] and len(r["members"]) >= 2],
                 180, "c to merge with the others again")
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes


def write_models(folder, d_model):
    folder.mkdir()
    (folder / "mymodels.py").write_text(textwrap.dedent(f'''
        from atoll.models.llama import Llama, LlamaConfig

        def small():
            return Llama(LlamaConfig(vocab_size=256, seq_len=32, d_model={d_model}, n_layers=1, n_heads=2,
                                     n_kv_heads=1))
    '''))


def test_a_users_model_trains_and_a_joiner_with_another_is_refused(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_models(ours, 32)
    write_models(theirs, 48)  # the same factory name, another version of the module: other shapes
    base = os.environ.get("PYTHONPATH", "")
    with LocalSwarm(tmp_path / "swarm", COMMON + ["--model", "mymodels:small"]) as swarm:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ours), base) if p))
        swarm.start("a", join=False)
        swarm.start("b")
        wait_for(lambda: all(len(shared_rounds(swarm.daemons[n], 2)) >= 3 for n in "ab"), 240,
                 "three 2-member rounds")
        assert_replicas_agree(swarm, "ab")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(theirs), base) if p))
        c = swarm.start("c")
        assert c.proc.wait(120) == 2
        errors = [line for line in c.log().splitlines() if "digest" in line]
        assert len(errors) == 1 and "other than the run's" in errors[0], c.log()[-2000:]
        assert "Traceback" not in c.log()
        codes = {n: swarm.stop(n) for n in "ab"}
        assert all(code == 0 for code in codes.values()), codes


@pytest.mark.parametrize("model, message", [
    ("no_such_package_here.models:small", "model: 'no_such_package_here.models:small': cannot import"),
    ("gpt-9000", "model: unknown 'gpt-9000'"),
])
def test_a_bad_model_is_one_line_and_exit_2(tmp_path, model, message):
    out = subprocess.run([sys.executable, "-m", "atoll.node.cli", "start", "--model", model, "--checkpoint-dir",
                          str(tmp_path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--open"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if message in line]) == 1
