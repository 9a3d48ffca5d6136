"""Taking the model home from a real private run of two daemons: ``atoll export`` from the live run (a member with
a join token of its own, downloading as a joiner does) writes exactly the global replica the daemons hold, which
their checkpoints hold too once they stop; and the daemons' figures land in TensorBoard and in a W&B offline run."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from scripts.swarm import LocalSwarm
from support.swarms import wait_for, wait_for_shared_rounds
from support.trackers import wandb_history

from atoll.node.home import export
from atoll.protocols.auth import RunKey

pytestmark = [pytest.mark.integration, pytest.mark.waits]

# A fragment's round every ~60 fast steps (about a second here) and records at most 0.3 s old: an export takes a
# fragment only while both daemons' records agree on it (two vouchers), which rounds every 20 steps against a 1 s
# heartbeat rarely left time for (CI: fragment 2 of 4 not vouched for within the export's 60 s).
COMMON = ["--model", "llama-nano", "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "60",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "0.3", "--eval-budget", "1"]


def atoll(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "atoll.node.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("take-home")
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    # The daemons inherit these: b logs to a W&B run on disk, never to the network.
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true")
    s = LocalSwarm(root, COMMON)
    try:
        s.start("a", ["--tensorboard", str(root / "tb")], join=False)
        s.start("b", ["--wandb", "atoll-test", "--wandb-name", "daemon-b"])
        yield s
    finally:
        s.stop_all(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name, d in s.daemons.items():
            print(f"----- {name} -----\n{d.log()[-4000:]}")


def identities(swarm):
    """Each daemon's (status, [(version, digest) per fragment]) as its progress record says."""
    out = atoll("status", "--initial-peers", *swarm.bootstrap, "--json", "--run-key", swarm.run_key, timeout=120)
    assert out.returncode == 0, out.stderr
    return {p["peer_id"]: (p["status"], [list(x) for x in zip(p["fragment_versions"], p["fragment_hashes"])])
            for p in json.loads(out.stdout)["peers"]}


def exported(swarm, out_dir, tmp_path):
    token = tmp_path / "exporter.token"
    if not token.exists():
        RunKey.load(swarm.run_key).issue_token("atoll").save(token)  # a member of its own, as the docs say
    out = atoll("export", "--initial-peers", *swarm.bootstrap, "--join-token", token, "--out", out_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "live run 'atoll'" in out.stdout, out.stdout
    meta = json.loads((out_dir / "atoll.json").read_text())
    return [[f["version"], f["digest"]] for f in meta["fragments"]]


def test_export_from_the_live_run_is_the_replica_the_daemons_hold(swarm, tmp_path):
    a, b = swarm.daemons["a"], swarm.daemons["b"]
    wait_for_shared_rounds(swarm, ["a", "b"], 2)
    # While both train: every fragment the export took is the result of a round the daemons merged, at that
    # version (the download checked the tensors against that digest; test_swarm checks both members of a round
    # end it with the same hash).
    taken = exported(swarm, tmp_path / "live", tmp_path)
    assert any(v > 0 for v, _ in taken), taken  # the run merged rounds: not Θ₀
    merged = {(r["fragment"], r["version"], r["hash"]) for d in (a, b) for r in d.rounds()}
    assert all((p, v, d) in merged for p, (v, d) in enumerate(taken) if v > 0), (taken, sorted(merged)[-8:])
    # The trained run's model in transformers, offline: the same function as atoll's.
    import transformers

    lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "live", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "live", local_files_only=True)
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    with torch.no_grad():
        theirs, ours = lm(input_ids=ids).logits, export.load(tmp_path / "live").model.logits(ids)
    # fp32, the same products summed in another order: the bound scales with the logits (a trained model's reach
    # 10 and more, where a fixed 1e-5 is a few ulps); a wrong or missing weight is off by far more.
    assert (theirs - ours).abs().max() < 1e-5 * max(1.0, float(ours.abs().max()))

    # The daemons' figures, read back by TensorBoard's reader and from the W&B run's own file (b leaves first:
    # its W&B run is finished when it stops).
    assert swarm.stop("b") == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [tb] = glob.glob(f"{swarm.root}/tb/atoll/*")
    acc = EventAccumulator(tb)
    acc.Reload()
    assert {"train/loss", "eval/held_out_loss", "rounds/merged", "net/bytes_sent"} <= set(acc.Tags()["scalars"])
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == sorted(steps) and steps[-1] >= 40
    assert acc.Scalars("rounds/merged")[-1].value >= 2

    [run_dir] = glob.glob(f"{swarm.root}/wandb/offline-run-*")
    rows = wandb_history(run_dir)
    assert len(rows) >= 4 and all("train/loss" in r for r in rows)
    assert any("eval/held_out_loss" in r for r in rows)

    # a alone, paused (it merges nothing and still serves its replica): the export is a's Θ, value for value, as
    # a's last checkpoint holds it once it leaves.
    out = atoll("pause", "--checkpoint-dir", a.workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    held = wait_for(lambda: (lambda ids: list(ids.values()) if [s for s, _ in ids.values()] == ["paused"] else None)(
        identities(swarm)), 90, "a paused and alone in the run")
    [(_, replica)] = held
    assert exported(swarm, tmp_path / "paused", tmp_path) == replica
    assert swarm.stop("a") == 0
    ours, theirs = export.load(tmp_path / "paused"), export.from_checkpoint(a.workdir)
    assert [[v, d] for v, _, d in theirs.identities] == replica
    for (k, x), (k2, y) in zip(ours.model.state_dict().items(), theirs.model.state_dict().items()):
        assert k == k2 and torch.equal(x, y), k


def test_export_of_an_unreachable_run_is_one_line(tmp_path):
    out = atoll("export", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
                "--out", tmp_path / "x", timeout=240)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    # Before it, one warning per bootstrap attempt that failed (as ``atoll start`` logs them).
    assert lines[-1].startswith("atoll: error: initial_peers: could not reach any bootstrap peer"), lines
