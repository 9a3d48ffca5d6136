"""A member of a run: the lifetime and step boundaries of every island, whoever runs its training loop.

Its lifetime:

- ``start()`` (entering the ``with`` block): start the DHT (retrying bootstrap) → agree on the run's
  configuration → build the trainee → check its model against the run's digest → restore a checkpoint, or download
  the swarm's state → wait for the peers the run waits for (those steps are ``arrival.py``'s). Every step of the
  loop comes after this, so state from peers (or from the checkpoint) is in the model before the first step.
- Each inner step ends at a *step boundary* (``boundary``): ``after_step()`` counts the step, starts the rounds due
  (or opened by peers), merges the landed ones and checkpoints once the last fragment merged; ``before_step()``
  loads the replicas the syncer adopted. Neither awaits the network (the synchronous algorithms block when a merge
  is due).
- ``close()`` (leaving the block, normally or by an exception): announce leaving, write a last checkpoint, stop the
  DHT.

Two loops use it. ``atoll start``'s (``daemon.py``) makes a ``Member`` around its ``Learner`` and calls the
boundaries itself, after its step's device sync. A user's loop wraps its model and optimizer in an ``Island``
(``island.py``): a ``Member`` whose boundaries are the optimizer's steps.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from atoll.models.data import shard_for_peer
from atoll.models.registry import model_digest
from atoll.protocols import codecs
from atoll.protocols.records import Status

from ..algorithm import algorithm
from ..config import NodeConfig
from ..run_config import ConfigError, RunConfig
from ..device import Device, codec_threads
from ..faults import Faults
from ..home import persist
from ..home.checkpoint import CheckpointWriter
from ..log import context as log_context
from ..metrics import Counters, HeldOut, MetricsLog, peak_rss_mib
from ..ops.exporter import MetricsEndpoint
from ..ops.trackers import Tracking, open_trackers
from ..pause_specs import Mode
from ..rounds.join import agree_on_run_config, start_member_dht
from ..rounds.rounds import Rounds
from ..rounds.syncer import Syncer
from ..trainee import Trainee
from . import arrival, pausing
from .ddp import DDP
from .ranks import IslandSync, OneRank, Ranks, step_boundary
from .sharded import ShardedSync

logger = logging.getLogger("atoll")
RATE_WINDOW = 5.0  # seconds over which tokens/s is measured
METRICS_EVERY = 10  # steps between progress events in metrics.jsonl

BuildTrainee = Callable[[NodeConfig, str], Trainee]  # (the agreed config, our peer id) -> the trainee
def check_step_tokens(run: RunConfig, tokens: int) -> None:
    """``ConfigError`` if this island trains more tokens a step than the run counts (``max_step_tokens``): its
    contributions would be cut to the run's bound in every round, the work above it counted for nothing."""
    if run.max_step_tokens and tokens > run.max_step_tokens:
        raise ConfigError(f"max_step_tokens: this island trains {tokens} tokens a step, the run counts at most "
                          f"{run.max_step_tokens} (set by the daemon that started it); train fewer (--batch-size, "
                          "--grad-accum) or start the run with a larger --max-step-tokens")


Derive = Callable[[RunConfig], dict[str, Any]]  # the run config fields a starter derives and publishes


class Stage(enum.Enum):
    """Where an island is in its lifetime: built, started (its loop's steps are the run's), or left."""

    NEW = "new"
    TRAINING = "training"
    CLOSED = "closed"


class Member:
    """One member of the run ``cfg`` names, from ``start`` to ``close`` (the module's docstring): ``build`` makes the
    trainee once the run config is agreed, ``derive`` the fields this member publishes if it starts the run
    (``join.agree_on_run_config``), and ``stop`` is the event the loop and the synchronous merges watch. The loop
    calls ``boundary`` after each step; ``rank_sync`` keeps the island's other ranks in step there (``OneRank``, an
    island of one rank, unless its owner sets another). ``print_addresses``: print the addresses to join at."""

    def __init__(self, cfg: NodeConfig, explicit: set[str], build: BuildTrainee, derive: Derive, device: Device,
                 stop: threading.Event, *, print_addresses: bool = True) -> None:
        self.cfg, self.explicit, self._build, self._derive = cfg, explicit, build, derive
        self.device, self.stop_event, self._print_addresses = device, stop, print_addresses
        codecs.set_threads(codec_threads(cfg.codec_threads, device.kind))
        self.faults = Faults(cfg.faults)
        self.harness = cfg.parsed_harness()
        self.counters = Counters()
        self.counters.device = device.describe()
        self.metrics = MetricsLog(None)
        self.checkpointer: CheckpointWriter | None = None
        self.checkpoints_written = 0
        self._checkpoint_due = False  # a checkpoint came due while the previous write was still going
        self.trainee: Trainee | None = None
        self._exit = contextlib.ExitStack()
        self.stage = Stage.NEW
        self._ranks = Ranks()  # this process's place in its island (a subclass on several ranks says otherwise)
        self.rank_sync: IslandSync | ShardedSync | OneRank = OneRank()
        self._paused: pausing.Paused | None = None

    # ---- what a loop reads ----------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Inner steps this member trained (after ``start``: a restored checkpoint's)."""
        return self.trainee.step if self.trainee is not None else 0

    @property
    def version(self) -> int:
        """The replica's version: outer rounds merged into it, summed over fragments."""
        return self.replica.total_version if self.trainee is not None else 0

    @property
    def stopping(self) -> bool:
        """True once something asked this member to stop (a signal to the daemon, ``request_stop``, or ``close``)."""
        return self.stop_event.is_set()

    def request_stop(self) -> None:
        """Ask the member to stop after the current step (safe from a signal handler)."""
        self.stop_event.set()

    # ---- lifetime -------------------------------------------------------------------------------------------
    def __enter__(self) -> Member:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Join the run (the module's docstring); ``ConfigError`` (one line) for what the user must fix."""
        try:
            self._start()
        except BaseException:
            self._exit.close()
            raise

    def _start(self) -> None:
        cfg = self.cfg
        endpoint = None
        if cfg.metrics_port >= 0:  # bound first: a port that is taken fails before the DHT is joined
            endpoint = MetricsEndpoint(cfg)
            self._exit.callback(endpoint.stop)
        dht, token, self.revocation, validators = start_member_dht(cfg, self.faults.namespaces(cfg.run_id))
        self._exit.callback(dht.shutdown)
        subkey = validators[0].local_public_key
        self.dht = dht
        self.peer_id = peer_id = str(dht.peer_id)
        log_context.peer_id = peer_id
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        if self._print_addresses:
            for maddr in self.maddrs:
                print(maddr, flush=True)
        logger.info("peer id %s; to join this run, pass one of %s as an initial peer", peer_id,
                    ", ".join(self.maddrs))
        self.cfg, config_record = agree_on_run_config(dht, cfg, self.explicit, token, subkey, derive=self._derive)
        cfg, run = self.cfg, self.cfg.run
        self.algorithm = algo = algorithm(run.algorithm)
        self.counters.algorithm = run.algorithm
        tracking = Tracking(open_trackers(cfg, peer_id), self._figures)
        self._exit.callback(tracking.close)
        self.metrics = MetricsLog(Path(cfg.checkpoint_dir) / "metrics.jsonl" if cfg.checkpoint_dir else None,
                                  (tracking.event,) if tracking.trackers else ())
        self._exit.callback(self.metrics.close)
        self.num_shards = run.num_shards
        self.shard = shard_for_peer(peer_id, run.num_shards)

        self.trainee = trainee = self._build(cfg, peer_id)
        digest = model_digest(trainee.model)
        if run.model_digest and digest != run.model_digest:
            raise ConfigError(f"model: this island's model has parameters (names, shapes, dtypes: digest {digest}) "
                              f"other than the run's (digest {run.model_digest}); build the run's model")
        check_step_tokens(run, trainee.tokens_per_step)
        self.held_out = HeldOut(cfg.eval_budget, self.counters)
        self.fragments, self.replica, self.local = arrival.build(trainee, cfg)
        resumed, error_feedback = False, {}
        if cfg.checkpoint_dir:
            self.checkpointer = CheckpointWriter(cfg.checkpoint_dir, self._checkpoint_written)
            restored = arrival.restore(cfg, trainee, self.fragments, self.local, self.counters, self.metrics)
            if restored is not None:
                (self.replica, error_feedback), resumed = restored, True
        self.counters.step, self.counters.tokens = trainee.step, trainee.tokens  # a restored one's, from the start
        self.syncer = syncer = Syncer(cfg, dht, subkey, self.replica, self.fragments, self.counters, self.faults,
                                      private=token is not None, config_record=config_record,
                                      run_public_key=token.run_public_key if token is not None else None,
                                      revocation=self.revocation, error_feedback=error_feedback)
        syncer.start()
        self._exit.callback(syncer.shutdown)
        if endpoint is not None:
            endpoint.serve(cfg, peer_id, self.counters, syncer, self.replica)
        if resumed:
            arrival.catch_up(cfg, syncer, self.replica, self.metrics)
        else:
            arrival.join(cfg, syncer, trainee, self.fragments, self.replica, self.local, self.metrics, self.shard,
                         self.stop_event)
        if algo.gradient_allreduce and self.replica.total_version > 0 and not resumed:
            raise ConfigError(f"algorithm: ddp runs have a fixed membership and this one is at step "
                              f"{self.replica.total_version}; start every ddp daemon together (see --quorum)")
        self.rounds = Rounds(cfg, algo, trainee, self.fragments, self.replica, self.local, syncer, self.counters,
                             self.metrics, self.held_out, self.stop_event)
        self.ddp = DDP(trainee, self.replica, self.local[0], syncer, self.counters, self.metrics, self.held_out,
                       self.stop_event) if algo.gradient_allreduce else None
        self.counters.status = Status.TRAINING
        arrival.wait_for_peers(syncer, run.quorum if algo.gradient_allreduce else self.harness.start_together,
                               self.stop_event)
        self.stage = Stage.TRAINING
        self.counters.started = self._window_start = time.monotonic()
        self._window_tokens = 0

    def close(self) -> None:
        """Leave the run: announce it, write a last checkpoint, stop the DHT. Safe to call more than once."""
        if self.stage is Stage.CLOSED:
            return
        trained, self.stage = self.stage is Stage.TRAINING, Stage.CLOSED
        self.stop_event.set()
        try:
            if trained:
                trainee, replica = self.trainee, self.replica
                self.counters.status = Status.LEAVING
                self.syncer.shutdown()
                self.checkpoint(wait=True)
                if self.checkpointer is not None:
                    self.checkpointer.wait()
                logger.info("stopped at step %d, version %d, peak resident memory %d MiB", trainee.step,
                            replica.total_version, peak_rss_mib())
                self.metrics.write(event="summary", **self.counters.summary(
                    self.syncer.stats, [v for v, _, _ in replica.identities()]))
        finally:
            self._exit.close()

    def _figures(self) -> dict[str, Any]:
        """The progress record's own fields and the bytes sent and received so far (the experiment trackers')."""
        stats = self.syncer.stats
        return {**self.counters.progress(), "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received}

    # ---- step boundaries --------------------------------------------------------------------------------------
    def boundary(self, loss: float | None = None, seconds: float | None = None,
                 stop: Callable[[], bool] = lambda: False) -> bool:
        """A step boundary, on every rank of the island at the same point (``ranks.step_boundary``): after a step
        of ``seconds`` (None before the first step, or after one that did not count) with its ``loss``, the
        island's ranks average the loss and mark θ; rank 0 counts the step, starts and merges rounds, checkpoints
        (``after_step``) and loads the replicas the syncer adopted (``before_step``), and what it wrote goes to the
        other ranks. Returns whether the island stops: ``stop()`` as every rank learns it."""
        trainee = self.trainee
        assert trainee is not None

        def lead(mean_loss: float | None) -> None:
            if seconds is not None:
                self.after_step(mean_loss, seconds)
            self.before_step()

        step = trainee.step if seconds is not None else None
        with torch.no_grad():  # merged values go into the leaf parameters in place
            stopping = step_boundary(self.rank_sync, step, self.cfg.run.sync_every, loss, stop,
                                     lead if self._ranks.leader else None)
        self.counters.rank_drift, self.counters.island_sync_seconds = self.rank_sync.drifted, self.rank_sync.seconds
        return bool(stopping)

    def before_step(self) -> None:
        """Load the replicas the syncer adopted into θ (a step boundary, before the loop's next step)."""
        self.rounds.before_step()

    def after_step(self, loss: float | None, seconds: float) -> None:
        """The trainee just finished a step of ``seconds`` (its counters advanced): count it, start and merge rounds,
        checkpoint at a consistent point. ddp's daemons report and checkpoint every H steps instead."""
        trainee, counters, run = self.trainee, self.counters, self.cfg.run
        counters.loss = loss
        counters.train_seconds += seconds
        counters.stepped(seconds)
        counters.step, counters.tokens = trainee.step, trainee.tokens
        log_context.step = trainee.step
        self.replica.schedule_step += 1
        for local in self.local:
            local.add_step(trainee.tokens_per_step)
        self._window_tokens += trainee.tokens_per_step
        elapsed = time.monotonic() - self._window_start
        if elapsed >= RATE_WINDOW:
            counters.tokens_per_s, self._window_start, self._window_tokens = self._window_tokens / elapsed, \
                time.monotonic(), 0
        if trainee.step % METRICS_EVERY == 0:
            self.metrics.write(step=trainee.step, tokens=trainee.tokens, loss=loss)
        if self.ddp is not None:
            if trainee.step % run.sync_every == 0:
                self.ddp.report()
                self.checkpoint()
        elif self.rounds.after_step():
            self.checkpoint()
        if self._checkpoint_due:
            self.checkpoint()

    # ---- pausing (pausing.py; atoll start's loop only) ----------------------------------------------------------
    def pause(self, reasons: list[str], mode: Mode) -> None:
        """Lend the machine back without leaving the run, between two steps (``pausing.pause``); ``resume`` undoes
        it."""
        self._paused = pausing.pause(self, reasons, mode)

    @property
    def paused(self) -> pausing.Paused | None:
        return self._paused

    def resume(self, leaving: bool = False) -> None:
        """Back from ``pause`` (``pausing.resume``); ``leaving``: θ back only, for the last checkpoint. If the device
        cannot take θ back, the error is raised and the island stays paused."""
        assert self._paused is not None
        pausing.resume(self, self._paused, leaving)
        self._paused = None
        if not leaving:
            self._window_start, self._window_tokens = time.monotonic(), 0

    def _checkpoint_written(self, meta: dict[str, Any]) -> None:
        self.counters.checkpoint_at = time.time()
        self.metrics.write(event="checkpoint", version=meta["version"], step=meta["step"], tokens=meta["tokens"])

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def checkpoint(self, wait: bool = False) -> None:
        """Copy the state to host memory (consistent at this step) and hand it to the background writer. While the
        previous write is still going (a slow disk), the checkpoint is taken at the first step boundary after it
        ends: the loop does not wait for a disk (``wait``: it does, when leaving)."""
        if self.checkpointer is None or self._paused is not None:  # paused: θ is not on the device, nothing to save
            return
        # One checkpoint's copy in host memory at a time: two coexisting copies were rank 0's peak.
        self._checkpoint_due = self.checkpointer.busy() and not wait
        if self._checkpoint_due:
            return
        self.checkpointer.wait()
        tensors, meta = persist.capture(self.cfg, self.peer_id, self.trainee, self.replica, self.local,
                                        self.syncer.error_feedback_state(), self.counters.tokens_lost,
                                        self.counters.tokens_carried)
        self.checkpoints_written += 1
        self.checkpointer.submit(tensors, meta, interrupt=self.faults.checkpoint_interrupt(self.checkpoints_written))

