"""The daemon, ``atoll start``: one per island, the first user of ``Member`` (``member.py``).

It builds its ``Learner`` (the run's model on its data shard, AdamW at the run's learning rates) once the island has
agreed on the run's configuration, then trains in a plain synchronous loop until stopped or ``--max-steps``, and
leaves: the island announces it, checkpoints and stops the DHT; exit 0.

The loop never awaits the network. It touches rounds through the island's two step boundaries,
``before_step()`` (load replicas the syncer adopted) and ``after_step()`` (count the step, start due rounds, merge
landed ones); ddp all-reduces gradients in its step instead (``ddp.py``).

Between two steps the loop may also pause (``pause.py``): the operator (``atoll pause``, through the control socket,
``control.py``) or a ``--pause-when``/``--schedule`` policy asks, and the island lends the device back without
leaving the run (``Member.pause``/``resume``); ``--max-hours``/``--until`` end the loop as a signal does.

Under torch's launcher (``torchrun``, or ``atoll start --nproc-per-node N``: ``launch.py``) every rank of the island
runs this daemon: rank 0 is the island's member of the swarm, as above; the others build the same learner from the
config rank 0 agreed and train in lockstep with it, taking what its boundaries wrote into θ (``ranks.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from atoll.models.data import BYTES, Corpus, load_corpus, load_held_out, shard_for_peer, tokenizer_of
from atoll.models.registry import ModelError, build_model, model_digest

from ..config import NodeConfig, check_socket_path
from ..run_config import OWN_MODEL, ConfigError, RunConfig
from ..device import Device, resolve_device
from ..faults import Faults
from ..metrics import peak_rss_mib
from ..pause_specs import Mode, PolicyError, deadline_of
from .control import ControlServer
from .learner import Learner, ShardedLearner
from .member import Member
from .pause import PauseState, policies_of
from .ranks import IslandSync, Ranks, init_island, leave_island, step_boundary
from .sharded import ShardedSync

logger = logging.getLogger("atoll")
RETRY_RESUME = 30.0  # seconds between attempts to take the device back when its memory is taken


class Daemon:
    def __init__(self, cfg: NodeConfig, explicit_run_fields: set[str]) -> None:
        self.cfg, self.explicit = cfg, explicit_run_fields
        self.stop = threading.Event()
        self.sync: IslandSync | None = None
        self.sharded = None  # sharded.ShardedSync of an --fsdp island
        self.control: ControlServer | None = None

    def run(self) -> int:
        ranks = Ranks.from_env()
        self.device = resolve_device(self.cfg.device, self.cfg.spmd_devices)
        if self.device.kind == "cuda" and ranks.world > 1:
            self.device = Device("cuda", torch.device("cuda", ranks.local_rank), self.device.precision)
        torch.set_num_threads(self.cfg.threads)
        self.ranks = ranks
        _, control = init_island(ranks, self.device.kind)
        try:
            if not ranks.leader:
                return self._follow(control)
            self._control = control
            world = ranks.world * self.device.devices  # an SPMD island's devices count as ranks
            self.island = island = Member(self.cfg, self.explicit, self._build_learner,
                                          functools.partial(derived_fields, cfg=self.cfg, world=world), self.device,
                                          self.stop)
            island.counters.ranks = world
            self._install_signal_handlers()  # before start: a SIGTERM during start-up still means a clean exit 0
            self.lending = self._lending()
            with contextlib.ExitStack() as leaving:
                leaving.callback(self._release_followers)  # after the island left: its close needs them too
                leaving.callback(self.lending.close)
                if ranks.world == 1:  # bound first: a taken socket fails before joining
                    self.control = self._control_server()
                    if self.control is not None:
                        leaving.callback(self.control.stop)
                leaving.enter_context(island)
                self._check_pausable()
                try:
                    if self.sync is not None:
                        self.sync.share_state(island.trainee)
                    island.rank_sync = self.sync or self.sharded or island.rank_sync
                    self._train()
                except RuntimeError as e:
                    if self.sync is None and self.sharded is None:
                        raise
                    # A collective of the island failed: a rank died. θ is as of the last boundary (no step applied
                    # half), so the island leaves with a checkpoint; the launcher restarts it from there. A sharded
                    # island cannot: part of θ was on the dead rank, so it restarts from its last checkpoint.
                    logger.error("lost a rank of this island (%s); leaving the run, to be restarted", _first_line(e))
                    if self.sharded is not None and island.checkpointer is not None:
                        island.checkpointer.wait()
                        island.checkpointer = None
                    return 1
            return 0
        finally:
            leave_island()

    # ---- lending the machine (pause.py) -------------------------------------------------------------------------
    def _lending(self) -> PauseState:
        """Who may pause this daemon (its policies; the operator through the control socket) and when it leaves."""
        cfg = self.cfg
        index = self.device.torch_device.index if self.device.kind == "cuda" else None
        policies = policies_of(cfg.pause_when, cfg.schedule, self.device.kind, index, logger.info)
        try:
            deadline = deadline_of(cfg.max_hours, cfg.until)
        except PolicyError as e:  # --until passed between the config's check and now
            raise ConfigError(f"until: {e}") from None
        return PauseState(policies, resume_after=cfg.resume_after, deadline=deadline)

    def _control_server(self) -> ControlServer | None:
        """The control socket: the one ``--control-socket`` names (its errors are the user's to fix), else the
        checkpoint dir's, skipped with a warning where that path cannot be a socket's (too long)."""
        path = self.cfg.control_path
        if path is None:
            return None
        if self.cfg.control_socket is None:
            try:
                check_socket_path(path)
            except ConfigError as e:
                logger.warning("no control socket (atoll pause cannot reach this daemon): %s", e)
                return None
        return ControlServer(path, self.lending, self._describe_pause)

    def _check_pausable(self) -> None:
        if self.island.ddp is None:
            return
        if self.cfg.pause_when or self.cfg.schedule:
            raise ConfigError("pause_when: a ddp run's membership is fixed, so a member cannot pause; use decoupled, "
                              "streaming or diloco to lend spare capacity")
        if self.control is not None:
            self.control.refusal = "a member of a ddp run cannot pause (its membership is fixed)"

    def _describe_pause(self) -> dict[str, Any]:
        paused = self.island.paused
        return {"freed_mib": paused.freed / 2**20} if paused is not None else {}

    def _pausable(self) -> bool:
        return self.island.ddp is None and self.sync is None and self.sharded is None

    def _pause(self, reasons: list[str]) -> bool:
        """Paused until no reason holds, or until the daemon must leave (then θ comes back for the last
        checkpoint, without a catch-up). False when θ could not come back to leave with."""
        island, lending = self.island, self.lending
        island.pause(reasons, Mode(self.cfg.pause_to))
        lending.paused = True
        try:
            while True:
                leaving = self.stop.is_set() or lending.expired()
                now = [] if leaving else lending.reasons()
                if not now:
                    try:
                        island.resume(leaving)
                        return True
                    except RuntimeError as e:  # out of memory: another job holds the device
                        if leaving:
                            logger.error("could not take the model back to leave with (%s); leaving without a "
                                         "last checkpoint (the previous one stays)", _first_line(e))
                            return False
                        logger.warning("could not take the device back (%s); staying paused, trying again in "
                                       "%.0f s", _first_line(e), RETRY_RESUME)
                        self.stop.wait(RETRY_RESUME)
                        continue
                if now != reasons:
                    logger.info("still paused: %s", ", ".join(now))
                    reasons = now
                lending.changed.wait(1.0)
                lending.changed.clear()
        finally:
            lending.paused = False

    def _build_learner(self, cfg: NodeConfig, peer_id: str) -> Learner:
        """The learner on its data shard with its held-out batches: the run's model as its seed initialises it on
        the CPU (the same Θ₀ on every daemon). Rank 0 of an island of several ranks first hands the agreed config
        to the others, which build the same learner (``_follow``)."""
        run = cfg.run
        if run.model == OWN_MODEL:
            raise ConfigError("model: this run's members build their model in Python (atoll.Island); pass --model "
                              "with a preset or a factory that builds the same parameters")
        if self.ranks.world > 1 and run.algorithm == "ddp":
            raise ConfigError("algorithm: ddp (a gradient all-reduce every step across the swarm) runs on islands of "
                              "one rank")
        if cfg.fsdp and self.ranks.world == 1:
            raise ConfigError("fsdp: shards over an island's ranks; give --nproc-per-node 2 or more (or run under "
                              "torchrun)")
        made = self._prepare(cfg, peer_id)
        if self.ranks.world > 1:
            sync = IslandSync(self.ranks, [], self._control)
            sync.share_config(cfg, peer_id)
            if cfg.fsdp:
                learner = ShardedLearner(run, self.device, *made, ranks=self.ranks, control=self._control)
                self.sharded = learner.sync
                _log_shard(self.ranks, learner)
                return learner
            self.sync = sync
        learner = Learner(run, self.device, *made, ranks=self.ranks)
        if self.sync is not None:
            self.sync.params = learner.params
        return learner

    def _release_followers(self) -> None:
        if self.sharded is not None:
            try:
                self.sharded.terminate()
            except RuntimeError:  # they are gone already (a rank died)
                pass

    def _prepare(self, cfg: NodeConfig, peer_id: str) -> tuple:
        """What ``Learner`` takes besides the run and the device: corpus, shard, batch size, precision, model,
        held-out batches, micro-batches per step. ``ConfigError`` for data or a model the run cannot use."""
        run = cfg.run
        try:
            tokens, vocab = load_corpus(run.data)
            held_out = load_held_out(run.data)
            ours = tokenizer_of(run.data)
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None
        if run.tokenizer and ours and ours != run.tokenizer:
            raise ConfigError(f"data: this run's data is {_tokenized(run.tokenizer)}, this daemon's "
                              f"{_tokenized(ours)}; tokenize it with the run's tokenizer.json (atoll data prepare --tokenizer)")
        try:
            model, shape = build_model(run.model, run.seed)
        except ModelError as e:
            raise ConfigError(f"model: {e}") from None
        if vocab > shape.vocab_size:
            raise ConfigError(f"data: tokens go up to {vocab - 1} but model {run.model!r} has vocab {shape.vocab_size}")
        try:
            corpus = Corpus(tokens, shape.seq_len, run.num_shards, held_out=held_out)
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None
        accumulate = micro_batches(cfg, self.ranks.world * self.device.devices)
        shard = cfg.parsed_harness().shard(shard_for_peer(peer_id, run.num_shards), run.num_shards)
        precision = None if cfg.precision == "auto" else cfg.precision  # None: the device's default
        return corpus, shard, cfg.batch_size, precision, model, corpus.held_out(cfg.eval_batches, cfg.batch_size), \
            accumulate

    def _follow(self, control) -> int:
        """A rank other than 0: the learner rank 0 describes, trained in lockstep with it until it stops. Its step
        boundaries are rank 0's (``ranks.step_boundary``), without rank 0's part."""
        self._ignore_stop_signals()
        sync: IslandSync | ShardedSync = IslandSync(self.ranks, [], control)
        try:  # every collective here fails when rank 0 is gone (it failed, or found bad configuration and left)
            cfg, peer_id = sync.receive_config()
            self.cfg = cfg
            if cfg.fsdp:
                learner: Learner = ShardedLearner(cfg.run, self.device, *self._prepare(cfg, peer_id), ranks=self.ranks,
                                                  control=control)
                sync = learner.sync
                _log_shard(self.ranks, learner)
                train = learner.train_step
            else:
                learner = Learner(cfg.run, self.device, *self._prepare(cfg, peer_id), ranks=self.ranks)
                sync.params = learner.params
                sync.receive_state(learner)
                logger.info("rank %d of %d: training with rank 0 from step %d", self.ranks.rank, self.ranks.world,
                            learner.step)
                train = learner.train_step_lagged if self.device.kind != "cpu" else learner.train_step
            faults, every = Faults(cfg.faults), cfg.run.sync_every
            stop = step_boundary(sync, None, every, None, lambda: False)  # rank 0's start and first boundary
            while stop is False:
                faults.island_step(self.ranks.rank, learner.step)
                loss = train()  # before reading the step: the boundary is at the step it reached
                stop = step_boundary(sync, learner.step, every, loss, lambda: False)
            sync.finish(stop)
        except RuntimeError as e:
            logger.error("rank %d: another rank of this island is gone (%s); leaving", self.ranks.rank,
                         _first_line(e))
            return 1
        digest = f", θ digest {sync.digest()}" if isinstance(sync, IslandSync) else ""
        logger.info("rank %d of %d: stopped with rank 0 at step %d%s, peak resident memory %d MiB", self.ranks.rank,
                    self.ranks.world, learner.step, digest, peak_rss_mib())
        return 0

    def _ignore_stop_signals(self) -> None:
        """A rank other than 0 stops when rank 0 says so at a boundary: a signal of its own (the launcher sends
        every rank one) must not end it in the middle of a collective rank 0 is about to make."""

        def handler(signum: int, _frame: Any) -> None:
            logger.info("rank %d: received %s; stopping when rank 0 does", self.ranks.rank,
                        signal.Signals(signum).name)

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # ---- the training loop ----------------------------------------------------------------------------------
    def _train(self) -> None:
        """The learner's loop: never awaits the network. Rounds run in the syncer; results merge at step
        boundaries (``Member.boundary``, which also keeps an island's other ranks in step). Only the synchronous
        algorithms (diloco, streaming) block when a merge is due."""
        island, lending = self.island, self.lending
        learner = island.trainee
        assert isinstance(learner, Learner)
        # On an accelerator, reading a step's loss waits for the device to finish that step; the previous step's
        # loss is ready, so the host traces step k+1 while the device runs step k (the reported loss lags a step).
        train = learner.train_step_lagged if self.device.kind != "cpu" else learner.train_step
        if island.ddp is not None:
            train = island.ddp.step  # the gradients averaged with the swarm's every step
        stopping = island.boundary(stop=self._done)
        while not stopping:
            reasons = lending.reasons() if self._pausable() else []
            if reasons:
                if not self._pause(reasons):
                    return
                stopping = island.boundary(stop=self._done)  # the replicas adopted meanwhile load first
                continue
            t0 = time.monotonic()
            island.harness.pace()
            island.faults.island_step(0, learner.step)
            before = learner.step
            loss = train()
            seconds: float | None = time.monotonic() - t0
            if learner.step == before:  # ddp: the step could not be averaged and was dropped
                island.counters.train_seconds += seconds
                seconds = None
            stopping = island.boundary(loss, seconds, self._done)
        memory = f"peak resident memory {peak_rss_mib()} MiB"
        if self.sync is not None:
            logger.info("rank 0 of %d: stopped at step %d, θ digest %s, %s", self.ranks.world, learner.step,
                        self.sync.digest(), memory)
        elif self.sharded is not None:
            logger.info("rank 0 of %d: stopped at step %d, %s", self.ranks.world, learner.step, memory)
        else:
            logger.info("stopped training at step %d, %s", learner.step, memory)

    def _done(self) -> bool:
        """Whether the loop stops at this boundary: asked to (a signal), the time lent is over (``--max-hours``,
        ``--until``), or ``--max-steps`` reached."""
        step = self.island.trainee.step
        self.lending.step = step
        if self.lending.expired() and not self.stop.is_set():
            logger.info("contributed for the time given (--max-hours/--until): leaving the run")
            self.stop.set()
        return self.stop.is_set() or (self.cfg.max_steps > 0 and step >= self.cfg.max_steps)

    def _install_signal_handlers(self) -> None:
        daemon_pid = os.getpid()

        def handler(signum: int, _frame: Any) -> None:
            if os.getpid() != daemon_pid:
                # hivemind's DHT process is forked from this one and inherits this handler: there it would only set
                # its own copy of the flag and ignore the signal (SIGTERM to the process group, as systemd sends it,
                # then never ended the daemon, which waited for its DHT process). It ends as by default instead.
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            logger.info("received %s: finishing the current step, then leaving", signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
        self.island.faults.install_signals()


def run_daemon(cfg: NodeConfig, explicit: set[str]) -> int:
    """Entry point used by the CLI; returns the process exit code."""
    try:
        return Daemon(cfg, explicit).run()
    except ConfigError:
        raise
    except KeyboardInterrupt:
        return 0
    finally:
        sys.stdout.flush()



def _log_shard(ranks: Ranks, learner: ShardedLearner) -> None:
    mine, whole = learner.local_parameter_bytes()
    logger.info("rank %d of %d: holds %d of the model's %d parameter bytes (fsdp)", ranks.rank, ranks.world, mine,
                whole)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def micro_batches(cfg: NodeConfig, world: int) -> int:
    """Micro-batches per inner step on each rank: ``grad_accum``, or what the run's ``global_batch`` makes of this
    island's ranks and batch size (``ConfigError`` when it does not divide, or disagrees with ``grad_accum``)."""
    run = cfg.run
    if not run.global_batch:
        return cfg.grad_accum
    per_pass = cfg.batch_size * world
    if run.global_batch % per_pass:
        raise ConfigError(f"global_batch: the run trains {run.global_batch} sequences per step, which is not a "
                          f"multiple of this island's batch_size {cfg.batch_size} x {world} rank(s)")
    accumulate = run.global_batch // per_pass
    if cfg.grad_accum not in (1, accumulate):
        raise ConfigError(f"grad_accum: {cfg.grad_accum} disagrees with the run's global_batch {run.global_batch} "
                          f"(batch_size {cfg.batch_size} x {world} rank(s) x {accumulate}); leave it unset")
    return accumulate


def derived_fields(run: RunConfig, cfg: NodeConfig, world: int) -> dict[str, Any]:
    """What the daemon that starts a run publishes for joiners to check: its model's digest, its data's tokenizer,
    and (unless set) the tokens a step any island may count, this island's own (``world``: its ranks)."""
    try:
        tokenizer = tokenizer_of(run.data)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    model, shape = _run_model(run)
    fields: dict[str, Any] = {"model_digest": model_digest(model), "tokenizer": tokenizer}
    if not run.max_step_tokens:
        fields["max_step_tokens"] = island_step_tokens(cfg, world, shape.seq_len)
    return fields


def island_step_tokens(cfg: NodeConfig, world: int, seq_len: int) -> int:
    """The tokens one inner step of this island trains: its sequences over ranks and micro-batches × seq_len."""
    return cfg.batch_size * micro_batches(cfg, world) * world * seq_len


def _tokenized(tokenizer: str) -> str:
    return "byte-level" if tokenizer == BYTES else f"tokenized by tokenizer sha256 {tokenizer[:16]}..."


def run_model_digest(run: RunConfig) -> str:
    """The digest of the run's model (``models/registry.py``)."""
    return model_digest(_run_model(run)[0])


def _run_model(run: RunConfig):
    """The run's model and its shape, built without memory on the meta device when the model allows it, else on
    the CPU."""
    try:
        with torch.device("meta"):
            return build_model(run.model, run.seed)
    except ModelError:
        try:
            return build_model(run.model, run.seed)  # a factory that needs real tensors (it loads weights, say)
        except ModelError as e:
            raise ConfigError(f"model: {e}") from None
