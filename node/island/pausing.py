"""An island lending its machine back without leaving the run, and taking it back (``atoll start``'s loop only;
the policies that decide when are ``pause.py``'s, the daemon's loop calls these between two steps)."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atoll.protocols.records import Status

from ..home.checkpoint import load_checkpoint
from ..metrics import current_rss_mib
from ..pause_specs import Mode
from . import arrival

if TYPE_CHECKING:
    from .member import Member

logger = logging.getLogger("atoll")


@dataclass
class Paused:
    since: float  # monotonic
    mode: Mode
    kept: dict[str, torch.Tensor] | None  # θ and the optimizer's state in host memory, or None: in the checkpoint
    freed: int  # bytes the trainee released
    step: int


def pause(island: Member, reasons: list[str], mode: Mode) -> Paused:
    """Finish the rounds in flight, tell the others we are ``paused`` (from then on no round expects us; we still
    serve our replica to whoever asks), and free θ, its gradients and the optimizer's state from the device, kept
    in host memory or in a checkpoint (``mode``; host memory where the checkpoint cannot be written)."""
    trainee, counters, checkpointer = island.trainee, island.counters, island.checkpointer
    assert trainee is not None
    began = time.monotonic()

    def paused() -> None:
        counters.status, counters.tokens_per_s = Status.PAUSED, 0.0
        island.syncer.announce()

    island.rounds.drain(2 * island.cfg.run.round_timeout + 2 * island.cfg.heartbeat, paused)
    held, rss = trainee.held_bytes(), current_rss_mib()
    if mode is Mode.CHECKPOINT:
        assert checkpointer is not None  # the configuration asks for --checkpoint-dir with --pause-to checkpoint
        failures = checkpointer.failures
        island.checkpoint(wait=True)
        checkpointer.wait()
        if checkpointer.failures > failures:
            logger.warning("the checkpoint could not be written: keeping the model's state in host memory instead")
            mode = Mode.HOST
    kept = trainee.release(keep=mode is Mode.HOST)
    gc.collect()
    state = Paused(time.monotonic(), mode, kept, held - trainee.held_bytes(), step=trainee.step)
    counters.pauses += 1
    rss_after = current_rss_mib()
    logger.info("paused at step %d (%s): %.1f MiB of model and optimizer state freed, kept in %s; resident "
                "memory %d -> %d MiB; still serving our replica", trainee.step, ", ".join(reasons),
                state.freed / 2**20, "host memory" if mode is Mode.HOST else "the checkpoint", rss, rss_after)
    island.metrics.write(event="paused", step=trainee.step, reasons=reasons, mode=mode.value, freed_bytes=state.freed,
                         held_bytes=trainee.held_bytes(), rss_mib_before=rss, rss_mib=rss_after,
                         seconds=time.monotonic() - began)
    return state


def resume(island: Member, paused: Paused, leaving: bool) -> None:
    """θ and the optimizer's state back onto the device, ``training`` again, then the replicas the swarm merged
    meanwhile, by replaying its rounds where the donors still hold them; the next ``before_step`` loads them into
    θ, and the work we had not merged is kept or counted lost as at any adoption (``Rounds``). ``leaving``: θ back
    only, for the last checkpoint. If the device cannot take θ back (another job holds its memory), the error is
    raised before anything changed."""
    trainee, counters, syncer = island.trainee, island.counters, island.syncer
    assert trainee is not None
    began = time.monotonic()
    trainee.reclaim(paused.kept if paused.kept is not None else _from_checkpoint(island.cfg.checkpoint_dir,
                                                                                 paused.step))
    counters.paused_seconds += began - paused.since
    if leaving:
        return
    counters.status = Status.TRAINING
    syncer.announce()
    syncer.take_open_rounds()  # opened while we were away: our own schedule follows the catch-up
    try:
        arrival.catch_up(island.cfg, syncer, island.replica, island.metrics)
    except TimeoutError:
        logger.warning("the catch-up after the pause did not finish in time; training on, the background "
                       "catch-up takes the replicas we are behind on")
    logger.info("resumed at step %d after %.0f s paused; ready to train in %.1f s", trainee.step,
                began - paused.since, time.monotonic() - began)
    island.metrics.write(event="resumed", step=trainee.step, paused_seconds=began - paused.since,
                         seconds=time.monotonic() - began, version=island.replica.total_version)


def _from_checkpoint(directory: str, step: int) -> dict[str, torch.Tensor]:
    loaded = load_checkpoint(directory)
    if loaded is None or loaded[1]["step"] != step:
        raise RuntimeError(f"the checkpoint written when pausing at step {step} is gone or changed; restart "
                           "the daemon (it resumes from its newest checkpoint)")
    return loaded[0]
