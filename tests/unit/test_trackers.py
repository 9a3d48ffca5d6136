"""Experiment trackers without a daemon: which events become which scalars, TensorBoard's event files and a W&B
offline run read back with their own readers, and a missing extra as one line."""

import glob
import sys

import pytest

from atoll.node.config import ConfigError, NodeConfig
from atoll.node.metrics import MetricsLog
from atoll.node.ops.trackers import FIGURES, HELD_OUT, TensorBoard, Tracking, WandB, open_trackers
from support.trackers import wandb_history


class Recorder:
    def __init__(self, fail=False):
        self.logged, self.fail, self.closed = [], fail, False

    def log(self, step, values):
        if self.fail:
            raise RuntimeError("disk full")
        self.logged.append((step, dict(values)))

    def close(self):
        self.closed = True


def progress(step, held_out=None, held_out_step=None):
    return {"step": step, "loss": 3.0 - step / 100, "tokens": 512 * step, "tokens_per_s": 1000.0, "goodput": 0.9,
            "rounds": step // 10, "rounds_skipped": 0, "tokens_lost": 0, "tokens_carried": 64, "bytes_sent": 10 * step,
            "bytes_received": 20 * step, "held_out_loss": held_out, "held_out_step": held_out_step, "device": "cpu"}


def test_progress_and_round_events_become_the_progress_records_figures():
    now = {}
    rec, bad = Recorder(), Recorder(fail=True)
    tracking = Tracking([bad, rec], lambda: now)
    log = MetricsLog(None, (tracking.event,))
    now.update(progress(10))
    log.write(step=10, tokens=5120, loss=2.9)
    now.update(progress(20, held_out=2.5, held_out_step=20))
    log.write(event="round", fragment=0, step=20)
    log.write(event="checkpoint", step=20, version=3)  # from the writer's thread: not a figure
    now.update(progress(30, held_out=2.5, held_out_step=20))
    log.write(step=30)
    log.write(step=25)  # a step in the past: never logged (W&B refuses it)
    assert [s for s, _ in rec.logged] == [10, 20, 30]
    assert set(rec.logged[0][1]) == set(FIGURES)  # no held-out evaluation yet
    assert rec.logged[1][1][HELD_OUT] == 2.5 and HELD_OUT not in rec.logged[2][1]  # once per evaluation
    assert rec.logged[2][1]["train/loss"] == pytest.approx(2.7) and rec.logged[2][1]["net/bytes_received"] == 600
    assert bad not in tracking.trackers  # the failing one was dropped; the other went on
    tracking.close()
    assert rec.closed


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    now = {}
    tracking = Tracking([TensorBoard(tmp_path / "run" / "peer")], lambda: now)
    for step in (10, 20, 30):
        now.update(progress(step, held_out=2.0 + step / 100, held_out_step=step))
        tracking.event({"step": step})
    tracking.close()
    acc = EventAccumulator(str(tmp_path / "run" / "peer"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(FIGURES) | {HELD_OUT}
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars(HELD_OUT)] == [(10, 2.1), (20, 2.2), (30, 2.3)]
    assert [e.step for e in acc.Scalars("train/tokens")] == [10, 20, 30]


def test_a_wandb_offline_run_holds_the_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    now = {}
    tracking = Tracking([WandB("atoll-test", "run-peer", "run", {"model": "nano"})], lambda: now)
    for step in (10, 20):
        now.update(progress(step, held_out=2.0, held_out_step=20 if step == 20 else None))
        tracking.event({"step": step})
    tracking.close()
    [run_dir] = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    rows = wandb_history(run_dir)
    assert [int(r["_step"]) for r in rows] == [10, 20]
    assert float(rows[0]["train/loss"]) == pytest.approx(2.9) and HELD_OUT not in rows[0]
    assert float(rows[1][HELD_OUT]) == 2.0


def test_a_missing_extra_is_one_line(monkeypatch, tmp_path):
    cfg = NodeConfig(tensorboard=str(tmp_path / "tb"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"^tensorboard: the tensorboard package is missing: pip install "
                                          r"'atoll\[tensorboard\]'"):
        open_trackers(cfg, "QmPeer")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"^wandb: the wandb package is missing: pip install 'atoll\[wandb\]'"):
        open_trackers(NodeConfig(wandb="proj"), "QmPeer")


@pytest.mark.parametrize("field,value", [("wandb", "a/b"), ("wandb", ""), ("wandb_name", "x" * 129),
                                         ("tensorboard", " ")])
def test_tracker_settings_are_checked(field, value):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        NodeConfig(**{field: value}).validate()


def test_an_island_takes_the_trackers_as_options(tmp_path):
    import torch

    import atoll

    model = torch.nn.Linear(2, 2)
    island = atoll.Island(model, torch.optim.SGD(model.parameters(), lr=0.1), tensorboard=str(tmp_path / "tb"),
                          wandb="my-project", wandb_name="mine")
    assert (island.cfg.tensorboard, island.cfg.wandb, island.cfg.wandb_name) == (str(tmp_path / "tb"), "my-project",
                                                                                "mine")
    with pytest.raises(ConfigError, match="^wandb: "):
        atoll.Island(model, torch.optim.SGD(model.parameters(), lr=0.1), wandb="a/b")
