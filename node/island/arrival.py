"""How an island arrives in its run, after the run's configuration is agreed and before its first step: its
model cut into fragments (Θ₀: the model as built, the same seed on every member), then its own newest good
checkpoint or, failing that, the swarm's state (downloaded from live peers, or waited for while none holds a run
that already got somewhere), then the fragments the swarm moved past while it was away, and the peers a run
waits for before its first step (``Member._start`` calls these in that order; ``pausing.resume`` catches up too)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from hivemind.utils import get_dht_time

from atoll.models.fragments import Fragment, make_fragments
from atoll.models.registry import embedding_of
from atoll.protocols.records import Status

from ..config import ConfigError, NodeConfig
from ..home import persist
from ..home.checkpoint import checkpoints
from ..log import context as log_context
from ..metrics import Counters, MetricsLog
from ..rounds.local_state import LocalFragmentState
from ..rounds.replica import Replica
from ..rounds.syncer import Syncer
from ..trainee import Trainee

logger = logging.getLogger("atoll")


def replica_id(replica: Replica, p: int) -> tuple[int, str]:
    version, _, digest = replica.identity(p)
    return version, digest


def build(trainee: Trainee, cfg: NodeConfig) -> tuple[list[Fragment], Replica, list[LocalFragmentState]]:
    """The model's fragments, Θ₀ (the trainee's model as built: the same seed on every member) as the replica of
    each, and our state against it."""
    run = cfg.run
    try:
        fragments = make_fragments(trainee.params, run.num_fragments, run.sync_every,
                                   embedding=embedding_of(trainee.model))
    except ValueError as e:
        raise ConfigError(f"fragments: {e}") from None
    replica = Replica([trainee.gather(f) for f in fragments])
    local = [LocalFragmentState(trainee.gather(f), replica_id(replica, p)) for p, f in enumerate(fragments)]
    return fragments, replica, local


def restore(cfg: NodeConfig, trainee: Trainee, fragments: list[Fragment], local: list[LocalFragmentState],
            counters: Counters, metrics: MetricsLog) -> tuple[Replica, dict[str, torch.Tensor]] | None:
    """Resume from our newest checkpoint in ``--checkpoint-dir`` that fits the model, if there is one: the
    trainee and ``local`` take its state; returned, its replica and error-feedback state."""
    misfit = None
    for tensors, meta in checkpoints(cfg.checkpoint_dir):
        try:
            replica, error_feedback = persist.restore(cfg, tensors, meta, trainee, fragments, local)
            break
        except persist.Mismatch as e:
            misfit = misfit or e
            logger.warning("checkpoint of step %s does not fit this model (%s); trying an older one",
                           meta.get("step"), e)
    else:
        if misfit is not None:  # the learner may be loaded in part: no fresh start from it
            raise ConfigError(f"checkpoint_dir: no checkpoint in {cfg.checkpoint_dir!r} fits this model "
                              f"({misfit}); move them away to start afresh")
        return None
    counters.tokens_lost = meta["tokens_lost"]
    counters.tokens_carried = meta.get("tokens_carried", 0)  # absent from checkpoints before the delta rule
    log_context.step = trainee.step
    logger.info("resumed from checkpoint: version %d, step %d, data position %d", meta["version"], meta["step"],
                meta["position"])
    metrics.write(event="resumed", version=meta["version"], step=meta["step"], position=meta["position"])
    return replica, error_feedback


def join(cfg: NodeConfig, syncer: Syncer, trainee: Trainee, fragments: list[Fragment], replica: Replica,
         local: list[LocalFragmentState], metrics: MetricsLog, shard: int, stop: threading.Event) -> None:
    """A new member: take every fragment's heaviest replica among live peers (or Θ₀ if there are none)."""
    states = _download_or_wait(cfg, syncer, len(fragments), stop)
    for p, fragment in enumerate(fragments):
        theta_p, base_id = replica.params_and_id(p)
        trainee.put(fragment, theta_p)
        local[p] = LocalFragmentState(theta_p, base_id)
    if len(states) == len(fragments):
        replica.schedule_step = states[0].schedule_step
        logger.info("joined at version %d from %s (shard %d)", replica.total_version,
                    ", ".join(sorted({d[-8:] for st in states for d in st.donors})), shard)
        metrics.write(event="joined", version=replica.total_version, donor=states[0].donor,
                      donors=[list(s.donors) for s in states], resumed_bytes=[s.resumed_bytes for s in states],
                      bytes_received=syncer.stats.bytes_received)  # what joining cost: the whole state
    else:
        logger.info("no peer holds state yet: starting from the seed's initial model (shard %d)", shard)


def _download_or_wait(cfg: NodeConfig, syncer: Syncer, fragments: int, stop: threading.Event) -> list[Any]:
    """Every fragment's heaviest replica among live peers. If none holds the state of a run that already got
    somewhere (its members' notes say so), a newcomer must not start it over from the seed: it waits for a
    holder to return, up to ``state_wait`` (then ``ConfigError``), unless ``restart_run`` says to."""
    timeout = max(60.0, 4 * cfg.run.round_timeout)
    states = syncer.download_initial_state(timeout=timeout)
    if len(states) == fragments:
        return states
    head = syncer.run_head()
    if head is None or head.version == 0:
        return states  # a new run: start from the seed
    if cfg.restart_run:
        logger.warning("run %r got to version %d but no live daemon holds its state: starting it over from the "
                       "seed's initial model, as --restart-run asks", cfg.run_id, head.version)
        return states
    deadline, said = time.monotonic() + cfg.state_wait, 0.0
    while not stop.is_set():
        if time.monotonic() - said > 30:
            ago = max(0.0, get_dht_time() - head.time)
            logger.warning("run %r got to version %d (noted by %s %.0f s ago) and no live daemon holds its state: "
                           "waiting up to %.0f s for one to return (or pass --restart-run)", cfg.run_id,
                           head.version, head.peer_id[-8:], ago, deadline - time.monotonic())
            said = time.monotonic()
        if time.monotonic() > deadline:
            raise ConfigError(f"state_wait: run {cfg.run_id!r} got to version {head.version} and no daemon holding "
                              f"its state came back in {cfg.state_wait:.0f} s; start one that holds it (its "
                              "--checkpoint-dir), or pass --restart-run to start the run over from the seed")
        stop.wait(5.0)
        states = syncer.download_initial_state(timeout=timeout)
        if len(states) == fragments:
            return states
        head = syncer.run_head() or head
    return states


def catch_up(cfg: NodeConfig, syncer: Syncer, replica: Replica, metrics: MetricsLog) -> None:
    """A restarted (or resumed) member: download the fragments the swarm moved past while we were away, before
    training."""
    states = syncer.catch_up_now(timeout=max(60.0, 4 * cfg.run.round_timeout))
    if states:
        # The run's sync schedule went on without us: take the donors' place in it, as a joiner does. Kept at
        # the checkpoint's, our rounds fall due some steps after theirs, every time, and a decoupled round
        # closes before we join it.
        replica.schedule_step = states[0].schedule_step
        logger.info("caught up on %d fragment(s) to version %d before training", len(states), replica.total_version)
        metrics.write(event="caught_up", version=replica.total_version, fragments=[s.fragment for s in states],
                      donors=[list(s.donors) for s in states], replayed=[len(s.rounds) for s in states])


def wait_for_peers(syncer: Syncer, count: int, stop: threading.Event) -> None:
    """Hold the first step until ``count`` members (this one included) are training."""
    logged = False
    while count and not stop.is_set():
        training = sum(peer.status == Status.TRAINING for peer in syncer.peers().values()) + 1
        if training >= count:
            return
        if not logged:
            logger.info("waiting for %d daemons to start together (%d training)", count, training)
            logged = True
        stop.wait(0.2)

