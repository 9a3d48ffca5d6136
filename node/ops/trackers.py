"""Experiment trackers: a daemon's figures in TensorBoard or Weights & Biases, next to its users' other runs.

One tracker run per daemon, grouped by the run id: TensorBoard writes under ``DIR/<run id>/<peer id>`` (point
``tensorboard --logdir DIR`` at it: each daemon is a run, the run id its folder); Weights & Biases logs to
``--wandb PROJECT`` with the run id as the group and ``--wandb-name`` (default ``<run id>-<peer id's last 8>``) as
the run's name, and honours ``WANDB_MODE`` (``offline``: a local run directory ``wandb sync`` uploads later) and
``WANDB_DIR``. Both are optional extras (``atoll[tensorboard]``, ``atoll[wandb]``); a missing one is a
``ConfigError`` naming it.

``Tracking`` hears every event of ``metrics.jsonl`` (``MetricsLog``'s sinks) and logs, at each progress event
(every ``METRICS_EVERY`` steps) and each merged round, the figures the progress record holds (``FIGURES``), at the
inner step: loss, held-out loss (once per evaluation), tokens and tokens/s, rounds merged and skipped, tokens lost
and carried, goodput, and the bytes sent and received. It never raises into the training loop: a tracker that
fails is logged once and left out.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..config import ConfigError, NodeConfig

logger = logging.getLogger("atoll")

# tag -> the progress record's field it logs
FIGURES = {
    "train/loss": "loss", "train/tokens": "tokens", "train/tokens_per_s": "tokens_per_s", "train/goodput": "goodput",
    "rounds/merged": "rounds", "rounds/skipped": "rounds_skipped", "tokens/lost": "tokens_lost",
    "tokens/carried": "tokens_carried", "net/bytes_sent": "bytes_sent", "net/bytes_received": "bytes_received",
}
HELD_OUT = "eval/held_out_loss"


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """Scalars into TensorBoard event files under ``directory`` (torch's ``SummaryWriter``)."""

    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"tensorboard: the tensorboard package is missing: pip install 'atoll[tensorboard]' "
                              f"({e})") from None
        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory))

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A Weights & Biases run (``wandb.init``: project, group = run id, name)."""

    def __init__(self, project: str, name: str, group: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(f"wandb: the wandb package is missing: pip install 'atoll[wandb]' ({e})") from None
        try:
            self._run = wandb.init(project=project, name=name, group=group, config=config, job_type="daemon",
                                   reinit="create_new")
        except Exception as e:  # noqa: BLE001 - no login, no network in online mode: one line
            raise ConfigError(f"wandb: could not start a run in project {project!r} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); WANDB_MODE=offline logs without an account") from None

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def open_trackers(cfg: NodeConfig, peer_id: str) -> list[Tracker]:
    """The trackers ``cfg`` asks for (``--tensorboard``, ``--wandb``), started; ``ConfigError`` for a missing extra."""
    out: list[Tracker] = []
    if cfg.tensorboard:
        out.append(TensorBoard(Path(cfg.tensorboard) / cfg.run_id / _safe(peer_id)))
    if cfg.wandb:
        config = {**cfg.run.published(), "peer_id": peer_id, "batch_size": cfg.batch_size, "device": cfg.device}
        out.append(WandB(cfg.wandb, cfg.wandb_name or f"{cfg.run_id}-{peer_id[-8:]}", cfg.run_id, config))
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class Tracking:
    """Turns ``metrics.jsonl`` events into tracker scalars (see the module's docstring). ``figures()`` returns the
    daemon's progress record fields (``Counters.progress``) and its traffic's bytes."""

    def __init__(self, trackers: list[Tracker], figures: Callable[[], dict[str, Any]]) -> None:
        self.trackers, self.figures = list(trackers), figures
        self._held_out_step: int | None = None
        self._last_step = -1

    def event(self, fields: dict[str, Any]) -> None:
        kind, step = fields.get("event"), fields.get("step")
        if kind not in (None, "round") or not isinstance(step, int) or step < self._last_step:
            return  # a checkpoint's event comes from the writer's thread, at a step that may be past
        self._last_step = step
        now = self.figures()
        values = {tag: float(now[key]) for tag, key in FIGURES.items() if isinstance(now.get(key), (int, float))}
        held_out, at = now.get("held_out_loss"), now.get("held_out_step")
        if isinstance(held_out, float) and at is not None and at != self._held_out_step:
            self._held_out_step = at
            values[HELD_OUT] = held_out
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as e:  # noqa: BLE001 - training goes on without it
                logger.warning("experiment tracker %s failed (%r); no more figures go to it", type(tracker).__name__,
                               e)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                logger.warning("experiment tracker %s did not close cleanly (%r)", type(tracker).__name__, e)
        self.trackers = []
