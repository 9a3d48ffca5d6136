"""The daemon: one per island. Its lifetime, top to bottom:

start the DHT (retrying bootstrap) → agree on the run's configuration → restore a checkpoint or download the
swarm's state → train in a plain synchronous loop until stopped → announce leaving, checkpoint, exit 0.

The loop never awaits the network. It touches rounds through two calls, ``rounds.before_step()`` (load replicas
the syncer adopted) and ``rounds.after_step()`` (start due rounds, merge landed ones); ddp all-reduces gradients
in its step instead (``ddp.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from atoll.models.registry import ModelError, build_model, embedding_of, model_digest
from atoll.models.data import Corpus, load_corpus, shard_for_peer
from atoll.models.fragments import make_fragments
from atoll.protocols.records import Status, make_validators

from . import persist
from .algorithm import algorithm
from .checkpoint import CheckpointWriter, load_checkpoint
from .config import ConfigError, NodeConfig, RunConfig
from .ddp import DDP
from .device import resolve_device
from .faults import Faults
from .join import agree_on_run_config, check_identity, identity_file, load_revocation, membership, start_dht
from .learner import Learner
from .local_state import LocalFragmentState
from .log import context as log_context
from .metrics import Counters, HeldOut, MetricsLog
from .replica import Replica
from .rounds import Rounds
from .syncer import Syncer

logger = logging.getLogger("atoll")
RATE_WINDOW = 5.0  # seconds over which tokens/s is measured


class Daemon:
    def __init__(self, cfg: NodeConfig, explicit_run_fields: set[str]) -> None:
        self.cfg, self.explicit = cfg, explicit_run_fields
        self.stop = threading.Event()
        self.faults = Faults(cfg.faults)
        self.counters = Counters()
        self.metrics = MetricsLog(Path(cfg.checkpoint_dir) / "metrics.jsonl" if cfg.checkpoint_dir else None)
        self.checkpointer: CheckpointWriter | None = None
        self.checkpoints_written = 0

    def run(self) -> int:
        self._install_signal_handlers()  # first: a SIGTERM during start-up still means a clean exit 0
        self.device = resolve_device(self.cfg.device)
        self.counters.device = self.device.describe()
        torch.set_num_threads(self.cfg.threads)
        token = membership(self.cfg)
        self.revocation = load_revocation(self.cfg, token)
        validators = make_validators(self.cfg.run_id, token, self.revocation)
        subkey = validators[0].local_public_key
        identity, temporary = identity_file(self.cfg, token)
        try:
            dht = start_dht(self.cfg, validators, identity_path=identity)
        finally:
            if temporary:
                os.unlink(identity)
        try:
            check_identity(dht, token)
            return self._run_with_dht(dht, token, subkey)
        finally:
            dht.shutdown()

    def _run_with_dht(self, dht: DHT, token: Any, subkey: bytes) -> int:
        self.peer_id = peer_id = str(dht.peer_id)
        log_context.peer = peer_id[-8:]
        for maddr in dht.get_visible_maddrs():
            print(maddr, flush=True)
        logger.info("peer id %s; to join this run: atoll start --initial-peers <one of the lines above>", peer_id)
        self.cfg, config_record = agree_on_run_config(dht, self.cfg, self.explicit, token, subkey,
                                                      digest=run_model_digest)
        cfg, run = self.cfg, self.cfg.run
        algo = algorithm(run.algorithm)
        self.counters.algorithm = run.algorithm

        shard, held_out = self._build_model(peer_id)
        resumed, error_feedback = self._restore()
        learner, fragments, replica = self.learner, self.fragments, self.replica
        self.counters.step, self.counters.tokens = learner.step, learner.tokens  # a restored daemon's, from the start
        self.syncer = syncer = Syncer(cfg, dht, subkey, replica, fragments, self.counters, self.faults,
                                      private=token is not None, config_record=config_record,
                                      run_public_key=token.run_public_key if token is not None else None,
                                      revocation=self.revocation,
                                      error_feedback=error_feedback)
        syncer.start()
        if resumed:
            self._catch_up()
        else:
            self._join(shard)
        if algo.gradient_allreduce and replica.total_version > 0 and not resumed:
            raise ConfigError(f"algorithm: ddp runs have a fixed membership and this one is at step "
                              f"{replica.total_version}; start every ddp daemon together (see --quorum)")

        self.rounds = Rounds(cfg, algo, learner, fragments, replica, self.local, syncer, self.counters,
                             self.metrics, held_out, self.stop)
        self.ddp = DDP(learner, replica, self.local[0], syncer, self.counters, self.metrics, held_out, self.stop)
        self.counters.status = Status.TRAINING
        try:
            self._wait_for_peers(run.quorum if algo.gradient_allreduce else self.faults.start_barrier())
            self._train(algo.gradient_allreduce)
        finally:
            self.counters.status = Status.LEAVING
            syncer.shutdown()
            self._checkpoint()
            if self.checkpointer is not None:
                self.checkpointer.wait()
            logger.info("stopped at step %d, version %d", learner.step, replica.total_version)
            self.metrics.write(event="summary", **self.counters.summary(
                syncer.stats, [v for v, _, _ in replica.identities()]))
            self.metrics.close()
        return 0

    def _build_model(self, peer_id: str) -> tuple[int, HeldOut]:
        """The learner on its data shard, the model's fragments, and Θ₀: the learner's initial model, the same seed
        on every daemon (initialised on the CPU). Returns the shard and the held-out evaluation."""
        cfg, run = self.cfg, self.cfg.run
        tokens, vocab = load_corpus(run.data)
        try:
            model, shape = build_model(run.model, run.seed)
        except ModelError as e:
            raise ConfigError(f"model: {e}") from None
        digest = model_digest(model)
        if run.model_digest and digest != run.model_digest:
            raise ConfigError(f"model: this daemon's {run.model!r} has parameters (names, shapes, dtypes: digest "
                              f"{digest}) other than the run's (digest {run.model_digest}); build the run's model")
        if vocab > shape.vocab_size:
            raise ConfigError(f"data: tokens go up to {vocab - 1} but model {run.model!r} has vocab {shape.vocab_size}")
        try:
            corpus = Corpus(tokens, shape.seq_len, run.num_shards)
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None
        shard = shard_for_peer(peer_id, run.num_shards)
        held_out = HeldOut(corpus.held_out(cfg.eval_batches, cfg.batch_size), cfg.eval_budget, self.counters)
        self.learner = learner = Learner(run, self.device, corpus, shard, cfg.batch_size, model=model)
        try:
            self.fragments = make_fragments(learner.params, run.num_fragments, run.sync_every,
                                            embedding=embedding_of(learner.model))
        except ValueError as e:
            raise ConfigError(f"fragments: {e}") from None
        self.replica = replica = Replica([f.gather(learner.params) for f in self.fragments])
        self.local = [LocalFragmentState(f.gather(learner.params), _replica_id(replica, p))
                      for p, f in enumerate(self.fragments)]
        return shard, held_out

    def _restore(self) -> tuple[bool, dict[str, torch.Tensor]]:
        """Resume from our newest good checkpoint, if there is one: whether we did, and the error-feedback state."""
        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return False, {}
        self.checkpointer = CheckpointWriter(cfg.checkpoint_dir, lambda meta: self.metrics.write(
            event="checkpoint", version=meta["version"], step=meta["step"], tokens=meta["tokens"]))
        loaded = load_checkpoint(cfg.checkpoint_dir)
        if loaded is None:
            return False, {}
        tensors, meta = loaded
        self.replica, error_feedback = persist.restore(cfg, tensors, meta, self.learner, self.fragments, self.local)
        self.counters.tokens_lost = meta["tokens_lost"]
        log_context.step = self.learner.step
        logger.info("resumed from checkpoint: version %d, step %d, data position %d", meta["version"], meta["step"],
                    meta["position"])
        self.metrics.write(event="resumed", version=meta["version"], step=meta["step"], position=meta["position"])
        return True, error_feedback

    def _join(self, shard: int) -> None:
        """A new daemon: take every fragment's heaviest replica among live peers (or Θ₀ if there are none)."""
        replica = self.replica
        states = self._download_or_wait()
        for p, fragment in enumerate(self.fragments):
            theta_p, base_id = replica.params_and_id(p)
            fragment.scatter(theta_p, self.learner.params)
            self.local[p] = LocalFragmentState(theta_p, base_id)
        if len(states) == len(self.fragments):
            replica.schedule_step = states[0].schedule_step
            logger.info("joined at version %d from %s (shard %d)", replica.total_version,
                        ", ".join(sorted({d[-8:] for st in states for d in st.donors})), shard)
            self.metrics.write(event="joined", version=replica.total_version, donor=states[0].donor,
                               donors=[list(s.donors) for s in states], resumed_bytes=[s.resumed_bytes for s in states],
                               bytes_received=self.syncer.stats.bytes_received)  # what joining cost: the whole state
        else:
            logger.info("no peer holds state yet: starting from the seed's initial model (shard %d)", shard)

    def _download_or_wait(self) -> list:
        """Every fragment's heaviest replica among live peers. If none holds the state of a run that already got
        somewhere (its members' notes say so), a newcomer must not start it over from the seed: it waits for a
        holder to return, up to ``state_wait`` (then ``ConfigError``), unless ``restart_run`` says to."""
        cfg = self.cfg
        timeout = max(60.0, 4 * cfg.run.round_timeout)
        states = self.syncer.download_initial_state(timeout=timeout)
        if len(states) == len(self.fragments):
            return states
        head = self.syncer.run_head()
        if head is None or head.version == 0:
            return states  # a new run: start from the seed
        if cfg.restart_run:
            logger.warning("run %r got to version %d but no live daemon holds its state: starting it over from the "
                           "seed's initial model, as --restart-run asks", cfg.run_id, head.version)
            return states
        deadline, said = time.monotonic() + cfg.state_wait, 0.0
        while not self.stop.is_set():
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
            self.stop.wait(5.0)
            states = self.syncer.download_initial_state(timeout=timeout)
            if len(states) == len(self.fragments):
                return states
            head = self.syncer.run_head() or head
        return states

    def _catch_up(self) -> None:
        """A restarted daemon: download the fragments the swarm moved past while we were away, before training."""
        states = self.syncer.catch_up_now(timeout=max(60.0, 4 * self.cfg.run.round_timeout))
        if states:
            logger.info("caught up on %d fragment(s) to version %d before training", len(states),
                        self.replica.total_version)
            self.metrics.write(event="caught_up", version=self.replica.total_version,
                               fragments=[s.fragment for s in states], donors=[list(s.donors) for s in states])

    # ---- the training loop ----------------------------------------------------------------------------------
    def _train(self, gradient_allreduce: bool) -> None:
        """The learner's loop: never awaits the network. Rounds run in the syncer; results merge at step
        boundaries. Only the synchronous algorithms (diloco, streaming) block when a merge is due."""
        cfg, learner, counters, run = self.cfg, self.learner, self.counters, self.cfg.run
        # On an accelerator, reading a step's loss waits for the device to finish that step; the previous step's
        # loss is ready, so the host traces step k+1 while the device runs step k (the reported loss lags a step).
        lagged_loss = self.device.kind != "cpu"
        window_start, window_tokens = time.monotonic(), 0
        counters.started = time.monotonic()
        while not self.stop.is_set() and (cfg.max_steps == 0 or learner.step < cfg.max_steps):
            self.rounds.before_step()
            t0 = time.monotonic()
            self.faults.before_step()
            before = learner.step
            if gradient_allreduce:
                counters.loss = self.ddp.step()
            else:
                counters.loss = learner.train_step_lagged() if lagged_loss else learner.train_step()
            elapsed_step = time.monotonic() - t0
            counters.train_seconds += elapsed_step
            if learner.step == before:  # ddp: the step could not be averaged and was dropped
                continue
            counters.stepped(elapsed_step)
            counters.step, counters.tokens = learner.step, learner.tokens
            log_context.step = learner.step
            self.replica.schedule_step += 1
            for local in self.local:
                local.add_step(learner.tokens_per_step)
            window_tokens += learner.tokens_per_step
            elapsed = time.monotonic() - window_start
            if elapsed >= RATE_WINDOW:
                counters.tokens_per_s, window_start, window_tokens = window_tokens / elapsed, time.monotonic(), 0
            if learner.step % 10 == 0:
                self.metrics.write(step=learner.step, tokens=learner.tokens, loss=counters.loss)
            if gradient_allreduce:
                if learner.step % run.sync_every == 0:
                    self.ddp.report()
                    self._checkpoint()
            elif self.rounds.after_step():
                self._checkpoint()

    def _wait_for_peers(self, count: int) -> None:
        """Hold the first step until ``count`` daemons (this one included) are training."""
        logged = False
        while count and not self.stop.is_set():
            training = sum(peer.status == Status.TRAINING for peer in self.syncer.peers().values()) + 1
            if training >= count:
                return
            if not logged:
                logger.info("waiting for %d daemons to start together (%d training)", count, training)
                logged = True
            self.stop.wait(0.2)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        """Copy the state to host memory (consistent at this step) and hand it to the background writer."""
        if self.checkpointer is None:
            return
        tensors, meta = persist.capture(self.cfg, self.peer_id, self.learner, self.replica, self.local,
                                        self.syncer.error_feedback_state(), self.counters.tokens_lost)
        self.checkpoints_written += 1
        self.checkpointer.submit(tensors, meta, interrupt=self.faults.checkpoint_interrupt(self.checkpoints_written))

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
        self.faults.install_signals()


def _replica_id(replica: Replica, p: int) -> tuple[int, str]:
    version, _, digest = replica.identity(p)
    return version, digest


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


def run_model_digest(run: RunConfig) -> str:
    """The digest of the run's model (``models/registry.py``), built without memory on the meta device when the
    model allows it, else on the CPU."""
    try:
        with torch.device("meta"):
            model, _ = build_model(run.model, run.seed)
    except ModelError:
        try:
            model, _ = build_model(run.model, run.seed)  # a factory that needs real tensors (it loads weights, say)
        except ModelError as e:
            raise ConfigError(f"model: {e}") from None
    return model_digest(model)
