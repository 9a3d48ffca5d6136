"""``atoll.Island`` around a user's own loop (``examples/own_loop.py``), with real daemons on loopback.

- One member alone, plain averaging (outer lr 1, momentum 0): the user's loop and ``atoll start`` end with
  bit-identical Θ, θ and optimizer state for the same seed, model and data: one code path behind both.
- Two user loops join a daemon's run after its first rounds (its state downloaded before their first step):
  rounds span all three with identical replicas, the held-out loss falls; a user loop restarted from its
  checkpoint gets its model and optimizer back, resumes its step count, and merges with the others again; every
  member leaves with exit 0 on SIGTERM.
- An exception in the user's loop goes through the ``with`` unchanged, and the island leaves the run cleanly on
  its way (last checkpoint, summary, DHT stopped).
- A user loop whose model differs from the run's refuses to join with one line, exit 2; so does a daemon
  joining a run whose members build their model in Python, without ``--model``.
- In this process, on ``ATOLL_TEST_DEVICE``'s device: rounds merge into the user's parameters on the device, and a
  new model and optimizer start from the checkpoint the island left, exactly.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import atoll
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import flatten
from atoll.models.registry import build_model
from scripts.swarm import LocalSwarm
from support.swarms import (assert_held_out_falls, assert_replicas_agree, resumes_and_merges_again,
                        stop_after_a_checkpoint, wait_for, wait_for_shared_rounds)

pytestmark = [pytest.mark.integration, pytest.mark.waits]
OWN_LOOP = str(Path(__file__).resolve().parents[2] / "examples" / "own_loop.py")
# The same run on both sides: one fragment (diloco), plain averaging, no compression, one shard (the peer ids
# differ, so with more shards the two would read different data).
RUN = {"algorithm": "diloco", "sync_every": "10", "outer_lr": "1", "outer_momentum": "0", "compression": "none",
       "num_shards": "1", "seed": "3"}


def newest_checkpoint(folder):
    meta = sorted(Path(folder).glob("ckpt-*.json"))[-1]
    return load_file(str(meta.with_suffix(".safetensors"))), meta


def test_the_api_loop_and_atoll_start_end_bit_identical(tmp_path):
    daemon = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "start", "--open", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--checkpoint-dir", str(tmp_path / "daemon"), "--model", "nano", "--batch-size", "8", "--max-steps", "40",
         "--inner-lr", "1e-3", "--warmup-steps", "20", *(f"--{k.replace('_', '-')}={v}" for k, v in RUN.items())],
        capture_output=True, text=True, timeout=240)
    assert daemon.returncode == 0, daemon.stderr[-3000:]
    api = subprocess.run(
        [sys.executable, OWN_LOOP, "--open", "--checkpoint-dir", str(tmp_path / "api"), "--model", "nano",
         "--batch-size", "8", "--steps", "40", "--lr", "1e-3", "--warmup", "20", "--seed", RUN["seed"],
         *(f"--set={k}={v}" for k, v in RUN.items())],
        capture_output=True, text=True, timeout=240)
    assert api.returncode == 0, api.stderr[-3000:]
    ours, ours_meta = newest_checkpoint(tmp_path / "api")
    theirs, theirs_meta = newest_checkpoint(tmp_path / "daemon")
    assert "version 4" in api.stderr and "version 4" in daemon.stderr  # four rounds merged on each side
    assert sorted(ours) == sorted(theirs)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"tensors that differ: {different[:5]}"
    assert any(k.startswith("opt.") for k in ours) and "replica.0.params" in ours


def test_an_island_merges_rounds_on_the_models_device_and_restarts_from_its_checkpoint(tmp_path, device_name):
    """One member alone, plain averaging: after its four rounds Θ is θ itself, bit for bit, on whatever device the
    user's model lives; a model of another seed and a new optimizer, on the same checkpoint directory, start where
    the island left: the step count, θ and the optimizer's state, exactly (tests/xla/test_xla_island.py on xla)."""
    tokens, _ = load_corpus("builtin")

    def member(seed):
        model, shape = build_model("nano", seed)
        model.to(device_name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        island = atoll.Island(model, optimizer, tokens_per_step=4 * shape.seq_len, open=True, log_level="WARNING",
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"], checkpoint_dir=str(tmp_path), algorithm="diloco",
                              sync_every=10, outer_lr=1.0, outer_momentum=0.0, compression="none")
        return model, optimizer, island, shape

    model, optimizer, island, shape = member(0)
    with island:
        corpus = Corpus(tokens, shape.seq_len, island.num_shards)
        for step in range(40):
            batch = corpus.batch_at(island.shard, 4 * step, 4).to(device_name)
            model(batch[:, :-1], batch[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        theta = flatten(p for p in model.parameters() if p.requires_grad)
        replica = island.replica.snapshot(0).params
        state = island.trainee.state_tensors()
    assert island.step == 40 and island.version == 4  # a round every 10 steps, merged into the model
    assert torch.equal(theta, replica)
    assert all(p.device.type == device_name for p in model.parameters())

    model, optimizer, restarted, _ = member(1)
    assert not torch.equal(flatten(model.parameters()), theta)
    with restarted:
        assert (restarted.step, restarted.version) == (40, 4)
        restored = restarted.trainee.state_tensors()
    assert restored.keys() == state.keys() and any(k.startswith("opt.") for k in state)
    assert not [k for k in state if not torch.equal(state[k], restored[k])]


def test_a_user_loop_under_torchrun_and_an_island_of_ranks_end_bit_identical(tmp_path):
    """Two ranks each: the user's DDP loop under torchrun with an ``atoll.Island`` on every rank, and ``atoll start
    --nproc-per-node 2``. Same seed, model, data slices and recipe: the same Θ, θ and optimizer state, and every
    rank of the user's island ends on rank 0's θ."""
    daemon = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "start", "--open", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--checkpoint-dir", str(tmp_path / "daemon"), "--model", "nano", "--batch-size", "4", "--max-steps", "40",
         "--nproc-per-node", "2", "--inner-lr", "1e-3", "--warmup-steps", "20",
         *(f"--{k.replace('_', '-')}={v}" for k, v in RUN.items())],
        capture_output=True, text=True, timeout=240)
    assert daemon.returncode == 0, daemon.stderr[-3000:]
    api = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", OWN_LOOP, "--open",
         "--checkpoint-dir", str(tmp_path / "api"), "--model", "nano", "--batch-size", "4", "--steps", "40",
         "--lr", "1e-3", "--warmup", "20", "--seed", RUN["seed"], *(f"--set={k}={v}" for k, v in RUN.items())],
        capture_output=True, text=True, timeout=240)
    assert api.returncode == 0, api.stderr[-3000:]
    assert "rank 1 of 2: following rank 0 from step 0" in api.stderr
    ours, _ = newest_checkpoint(tmp_path / "api")
    theirs, _ = newest_checkpoint(tmp_path / "daemon")
    assert "version 4" in api.stderr and "version 4" in daemon.stderr
    assert sorted(ours) == sorted(theirs)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"tensors that differ: {different[:5]}"
    summary = [line for line in (tmp_path / "api" / "metrics.jsonl").read_text().splitlines() if '"summary"' in line]
    assert summary and '"rank_drift": 0' in summary[-1] and '"ranks": 2' in summary[-1]


def test_user_loops_join_a_daemon_and_restart(tmp_path):
    common = ["--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20", "--gather-timeout", "8",
              "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1", "--harness", "step_delay=0.05"]
    own = ["--batch-size", "4", "--steps", "100000", "--step-delay", "0.05",
           *(f"--set={k}" for k in ("algorithm=diloco", "sync_every=20", "gather_timeout=8", "round_timeout=8",
                                    "heartbeat=1", "eval_budget=1"))]
    with LocalSwarm(tmp_path, common + ["--model", "nano"]) as swarm:
        swarm.start("a", join=False)
        wait_for(lambda: len(swarm.daemons["a"].rounds()) >= 2, 120, "a to merge two rounds alone")
        for name in "bc":
            swarm.start(name, own, program=OWN_LOOP)
        for name in "bc":  # the run's state, downloaded from a before the loop's first step
            joined = wait_for(lambda: re.findall(r"joined at version (\d+) from", swarm.daemons[name].log()), 120,
                              f"{name} to join")
            before = swarm.daemons[name].log().split("joined at version")[0]
            assert int(joined[0]) >= 2 and not re.search(r"step [1-9]\d*\]", before), before[-2000:]
        wait_for_shared_rounds(swarm, "abc", 3)
        assert_replicas_agree(swarm, "abc")
        assert_held_out_falls(swarm, "abc", founder="a", evaluations=3)
        resumes_and_merges_again(swarm, "c", stop_after_a_checkpoint(swarm, "c"), own, program=OWN_LOOP)
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes


def test_mismatched_models_are_refused(tmp_path):
    with LocalSwarm(tmp_path, ["--heartbeat", "1", "--open"], private=False) as swarm:
        swarm.start("a", ["--open", "--steps", "100000", "--step-delay", "0.05"], join=False, program=OWN_LOOP)
        # A user loop with another model: refused at the run's digest, before it trains or prints an address.
        b = subprocess.run([sys.executable, OWN_LOOP, "--open", "--model", "llama-nano", "--steps", "10",
                            "--checkpoint-dir", str(tmp_path / "b"), "--initial-peers", *swarm.bootstrap],
                           capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
        assert b.returncode == 2 and not b.stdout.strip(), (b.stdout, b.stderr[-2000:])
        err = b.stderr.strip().splitlines()
        assert err[-1].startswith("error: model:") and "other than the run's" in err[-1], err[-3:]
        assert "Traceback" not in b.stderr
        # A daemon without --model cannot build a model the run's members build in Python.
        c = swarm.start("c", ["--max-steps", "10"])
        assert c.proc.wait(120) == 2
        assert "atoll.Island" in c.log().strip().splitlines()[-1] and "Traceback" not in c.log(), c.log()[-2000:]
        # With --model naming a preset that builds the same parameters, it joins and trains.
        d = swarm.start("d", ["--model", "nano", "--max-steps", "30"])
        assert d.proc.wait(120) == 0, d.log()[-2000:]
        assert "joined run" in d.log()


FAILING_LOOP = '''
import sys
import torch
import atoll
from atoll.models.data import Corpus, load_corpus
from atoll.models.registry import build_model

model, shape = build_model("nano", 0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens, _ = load_corpus("builtin")
with atoll.Island(model, optimizer, open=True, checkpoint_dir=sys.argv[1], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                  algorithm="diloco", sync_every=5, tokens_per_step=4 * shape.seq_len) as island:
    corpus = Corpus(tokens, shape.seq_len, island.num_shards)
    for step in range(100):
        if step == 12:
            raise RuntimeError("the user's loop failed at step 12")
        batch = corpus.batch_at(island.shard, step * 4, 4)
        model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
'''


def test_an_exception_in_the_users_loop_leaves_the_run_cleanly(tmp_path):
    """The user's exception goes through the ``with`` unchanged; on its way the island announces leaving, writes
    a last checkpoint of the 12 steps trained (two rounds merged), writes its summary and stops its DHT process
    and p2pd (``communicate`` would wait out the timeout if a child still held the output pipes)."""
    script = tmp_path / "failing_loop.py"
    script.write_text(FAILING_LOOP)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=240, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.rstrip().endswith("RuntimeError: the user's loop failed at step 12"), out.stderr[-3000:]
    assert "stopped at step 12, version 2" in out.stderr, out.stderr[-3000:]
    _, meta = newest_checkpoint(tmp_path / "ckpt")
    assert json.loads(meta.read_text())["step"] == 12
    events = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "summary" and (events[-1]["step"], events[-1]["version"]) == (12, 2), events[-1]
