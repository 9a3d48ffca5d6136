"""Models other than the built-in GPT in a live swarm: the Llama-style preset trains in three daemons with
identical replicas and falling held-out loss, and a restarted daemon restores it; a user's own model from a
factory (``--model package.module:factory``) trains too, and a daemon whose factory builds other parameters
refuses to join with one line (exit 2); a bad factory path is one line, exit 2."""

import os
import subprocess
import sys
import textwrap

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import (MODELS_COMMON, assert_held_out_falls, assert_refused_in_one_line, assert_replicas_agree,
                        resumes_and_merges_again, stop_after_a_checkpoint, wait_for, wait_for_shared_rounds)

pytestmark = [pytest.mark.integration, pytest.mark.waits]
COMMON = MODELS_COMMON


def test_a_llama_swarm_trains_and_restarts(tmp_path):
    with LocalSwarm(tmp_path, COMMON + ["--model", "llama-nano"]) as swarm:
        for name in "abc":
            swarm.start(name, join=name != "a")
        wait_for_shared_rounds(swarm, "abc", 4)
        assert_replicas_agree(swarm, "abc")
        assert_held_out_falls(swarm, "abc", founder="a")
        # c restarts from its checkpoint: its Llama and its AdamW state come back, and it merges again.
        resumes_and_merges_again(swarm, "c", stop_after_a_checkpoint(swarm, "c"))
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
        wait_for_shared_rounds(swarm, "ab", 3)
        assert_replicas_agree(swarm, "ab")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(theirs), base) if p))
        assert_refused_in_one_line(swarm.start("c"), "digest", "other than the run's")
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


def prepared(tmp_path, name, vocab_size=300):
    from atoll.models.prepare import PrepareOptions, prepare

    texts = tmp_path / "texts"
    texts.mkdir(exist_ok=True)
    for i in range(40):
        (texts / f"{i}.txt").write_text(f"document {i}: " + " ".join(f"word{j * i % 97}" for j in range(400)))
    prepare([str(texts)], str(tmp_path / name), PrepareOptions(vocab_size=vocab_size))
    return tmp_path / name


def test_a_joiner_whose_data_another_tokenizer_made_is_refused(tmp_path, monkeypatch):
    """The daemon that starts a run publishes how its data was tokenized; a joiner with the same vocabulary but
    another tokenizer (token ids that mean other text) refuses to join with one line, exit 2."""
    ours, theirs = prepared(tmp_path, "ours", 300), prepared(tmp_path, "theirs", 320)
    models = tmp_path / "models"
    models.mkdir()
    (models / "bpemodels.py").write_text(textwrap.dedent('''
        from atoll.models.gpt import GPT, GPTConfig

        def gpt():
            return GPT(GPTConfig(vocab_size=512, seq_len=32, d_model=32, n_layers=1, n_heads=2))
    '''))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(models), os.environ.get("PYTHONPATH", "")) if p))
    with LocalSwarm(tmp_path / "swarm", COMMON + ["--model", "bpemodels:gpt"]) as swarm:
        a = swarm.start("a", ["--data", str(ours)], join=False)
        wait_for(lambda: a.rounds() or "step 20]" in a.log(), 120, "a to train")
        assert_refused_in_one_line(swarm.start("b", ["--data", str(theirs)]), "error",
                                   "this run's data is tokenized by tokenizer sha256")
        c = swarm.start("c", ["--data", str(ours), "--max-steps", "5"])  # the run's own data joins
        assert c.proc.wait(120) == 0, c.log()[-2000:]


def test_prepared_data_the_model_cannot_embed_or_a_broken_shard_is_one_line_and_exit_2(tmp_path):
    dataset = prepared(tmp_path, "ds")

    def start(*args):
        return subprocess.run([sys.executable, "-m", "atoll.node.cli", "start", "--open", "--host-maddrs",
                               "/ip4/127.0.0.1/tcp/0", "--data", str(dataset), *args], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    out = start("--model", "nano")  # 300 token ids, a model that embeds 256
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "atoll: error: data: tokens go up to 299 but model 'nano' has vocab 256" in out.stderr
    shard = sorted(dataset.glob("train-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated
    out = start("--model", "nano")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("atoll: error: data:") and shard.name in errors[0], errors


def test_a_corpus_of_two_windows_trains_and_a_smaller_one_is_one_line_and_exit_2(tmp_path):
    """Any corpus that makes one training batch and one held-out batch trains (nano: 65-token windows, so 130
    bytes); one byte less is one line naming the minimum, exit 2."""
    text = tmp_path / "tiny.txt"

    def start(size):
        text.write_bytes((bytes(range(97, 123)) * 5)[:size])
        return subprocess.run([sys.executable, "-m", "atoll.node.cli", "start", "--open", "--host-maddrs",
                               "/ip4/127.0.0.1/tcp/0", "--model", "nano", "--data", str(text), "--max-steps", "3",
                               "--checkpoint-dir", str(tmp_path / f"ckpt{size}")], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    out = start(130)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = start(129)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "corpus too small: 129 tokens" in errors[0] and "at least 130" in errors[0], errors
