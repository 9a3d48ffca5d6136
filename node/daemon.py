"""The daemon: one per island. Joins (or starts) a run, trains, merges through outer rounds, checkpoints.

Lifetime: validate config → start the DHT (retrying bootstrap) → agree on the run's configuration → restore a
checkpoint or download the swarm's state → train in a plain synchronous loop until stopped → announce leaving,
checkpoint, exit 0. The loop never awaits the network; it hands pseudo-gradients to the syncer and picks up
replicas the syncer adopted at step boundaries.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus, load_corpus, shard_for_peer
from atoll.models.fragments import make_fragments
from atoll.models.outer import pseudo_gradient, token_weight
from atoll.protocols.auth import AuthError, JoinToken, RunKey, fingerprint
from atoll.protocols.records import RunConfigRecord, config_key, make_validators, parse_run_config, unwrap_subkeys
from atoll.protocols.state_sync import MAX_ANCESTORS

from .checkpoint import CheckpointWriter, load_checkpoint
from .config import ConfigError, NodeConfig, reconcile_run_config
from .device import resolve_device
from .learner import Learner
from .local_state import LocalFragmentState
from .log import context as log_context
from .replica import Replica
from .syncer import RoundOutcome, Syncer

logger = logging.getLogger("atoll")
CONFIG_TTL = 24 * 3600.0


def start_dht(cfg: NodeConfig, validators: list, client_mode: bool = False) -> DHT:
    """Start hivemind's DHT, retrying bootstrap; ``ConfigError`` if no initial peer answers."""
    last_error: Exception | None = None
    for attempt in range(cfg.bootstrap_retries):
        try:
            return DHT(
                initial_peers=list(cfg.initial_peers), start=True, client_mode=client_mode,
                host_maddrs=list(cfg.host_maddrs), announce_maddrs=list(cfg.announce_maddrs) or None,
                identity_path=None if client_mode else cfg.identity_path, record_validators=validators,
                startup_timeout=30,
            )
        except Exception as e:  # hivemind raises plain Exceptions for bootstrap failures
            last_error = e
            if attempt + 1 < cfg.bootstrap_retries:
                logger.warning("DHT start failed (%s); retrying in %d s", e, 2 * (attempt + 1))
                time.sleep(2 * (attempt + 1))
    if cfg.initial_peers:
        raise ConfigError(
            f"initial_peers: could not reach any bootstrap peer after {cfg.bootstrap_retries} attempts ({last_error})"
        )
    raise RuntimeError(f"could not start the DHT: {last_error}")


@dataclass
class _Pending:
    future: concurrent.futures.Future
    merge_at: int  # schedule step at which the result is merged in (due step + τ)
    version: int
    delta: torch.Tensor | None = None  # our contribution (Θ_base − θ at the snapshot), kept for stale contributions


@dataclass
class _Snapshot:
    """A round about to start: θ_p on its way to host memory, and what the round is taken against."""

    theta: concurrent.futures.Future  # flat fp32 host θ_p as of the due step
    base: torch.Tensor  # Θ_base at that step (LocalFragmentState replaces, never mutates, its base)
    base_id: tuple[int, str]
    weight: float
    merge_at: int


@dataclass(eq=False)
class _MergedRound:
    """One of our recent merged rounds of a fragment, kept so that a fork that loses it can be detected (its
    ``digest`` is not an ancestor of the replica that won) and its work counted or contributed again."""

    digest: str  # the replica the round produced
    counters: tuple[int, int]  # the tokens and steps behind our part
    delta: torch.Tensor | None = None  # our part (Θ_base − θ at the snapshot), kept only for stale contributions


class Daemon:
    def __init__(self, cfg: NodeConfig, explicit_run_fields: set[str]) -> None:
        self.cfg, self.explicit = cfg, explicit_run_fields
        self.stop = threading.Event()
        self.status = "joining"
        self.loss: float | None = None
        self.held_out_loss: float | None = None
        self.tokens_per_s = 0.0
        self.metrics_file = None
        self.tokens_lost = 0
        self.train_seconds = 0.0
        self.blocked_seconds = 0.0
        self.started = time.monotonic()
        self.pending: dict[int, _Pending] = {}
        self.snapshots: dict[int, _Snapshot] = {}  # rounds whose θ_p snapshot is still on its way to the host
        self.merged_rounds: dict[int, list[_MergedRound]] = {}  # per fragment, newest last
        self.ddp_failed_steps = 0
        self.restored_error_feedback: dict[str, torch.Tensor] = {}
        self.checkpoints_written = 0
        self.checkpoint_kill_armed = False  # fault injection: die in the middle of the next checkpoint write
        self.checkpointer: CheckpointWriter | None = None
        self.eval_seconds = 0.0  # time spent on held-out evaluations (kept within cfg.eval_budget of wall time)
        self.held_out_step: int | None = None  # the step at which held_out_loss was measured
        self._metrics_lock = threading.Lock()  # metrics come from the training loop and the checkpoint writer

    # ---- set-up --------------------------------------------------------------------------------------------
    def _membership(self) -> JoinToken | None:
        """This daemon's membership of a private run (None: an open run). A join token, or a certificate issued to
        ourselves by the run key we hold; a new run without ``open`` creates its run key."""
        cfg = self.cfg
        if cfg.open:
            return None
        if cfg.join_token is not None:
            try:
                token = JoinToken.load(cfg.join_token)
            except AuthError as e:
                raise ConfigError(f"join_token: {e}") from None
            if token.run_id != cfg.run_id:
                raise ConfigError(f"join_token: the token is for run {token.run_id!r}, not {cfg.run_id!r}")
            return token
        path = cfg.run_key_path
        if cfg.initial_peers and (path is None or (cfg.run_key is None and not os.path.exists(path))):
            return None  # joining without credentials: fine for an open run; a private one refuses us clearly
        if path is None:
            raise ConfigError("run_key: a new run is private and needs a file for its run key: pass --checkpoint-dir "
                              "or --run-key (or --open for an open run that anyone may join)")
        try:
            key, created = RunKey.load_or_create(path)
        except AuthError as e:
            raise ConfigError(f"run_key: {e}") from None
        if created:
            logger.info("created the run key %s at %s; admit daemons with: atoll token --run-key %s --run-id %s "
                        "--out member.token", fingerprint(key.public_bytes), path, path, cfg.run_id)
        return key.issue_token(cfg.run_id)

    def _check_access(self, published: RunConfigRecord) -> None:
        """Refuse, with one clear line, to take part in a run whose access our credentials do not match."""
        run_id, token = self.cfg.run_id, self.token
        if published.access == "private" and token is None:
            raise ConfigError(f"join_token: run {run_id!r} is private (run key {published.run_key}); start with "
                              f"--join-token FILE, issued by a holder of the run key with `atoll token`")
        if published.access == "private" and fingerprint(token.run_public_key) != published.run_key:
            raise ConfigError(f"join_token: the token is for run key {fingerprint(token.run_public_key)}, "
                              f"run {run_id!r} uses {published.run_key}")
        if published.access == "open" and token is not None:
            raise ConfigError(f"join_token: run {run_id!r} is open; start without --join-token or --run-key")

    def _agree_on_run_config(self, dht: DHT) -> None:
        """Adopt the run's published config (joiners) or publish ours (the daemon that starts the run)."""
        key = config_key(self.cfg.run_id)
        published = None
        if self.cfg.initial_peers:
            for _ in range(5):
                records = [r for r in map(parse_run_config, unwrap_subkeys(dht.get(key, latest=True)).values())
                           if r is not None]
                if records:
                    published = min(records, key=lambda r: r.started_at)
                    break
                time.sleep(1)
        if published is not None:
            self._check_access(published)
            run = reconcile_run_config(self.cfg.run, self.explicit, published.fields)
            self.cfg = dataclasses.replace(self.cfg, run=run)
            self.config_record = published.dict()
            logger.info("joined run %r started by %s", self.cfg.run_id, published.started_by[-8:])
        else:
            private = self.token is not None
            self.config_record = RunConfigRecord(
                fields=self.cfg.run.published(), started_by=str(dht.peer_id), started_at=float(get_dht_time()),
                access="private" if private else "open",
                run_key=fingerprint(self.token.run_public_key) if private else None,
            ).dict()
            logger.info("starting a new %s run %r", "private" if private else "open", self.cfg.run_id)
        dht.store(key, self.config_record, expiration_time=get_dht_time() + CONFIG_TTL, subkey=self.subkey)

    def _progress(self) -> dict[str, Any]:
        learner = getattr(self, "learner", None)
        wall = max(time.monotonic() - self.started, 1e-9)
        return {
            "status": self.status, "device": self.device.describe(), "algorithm": self.cfg.run.algorithm,
            "step": learner.step if learner else 0, "tokens": learner.tokens if learner else 0,
            "tokens_per_s": float(self.tokens_per_s), "loss": _finite_or_none(self.loss),
            "held_out_loss": _finite_or_none(self.held_out_loss), "tokens_lost": int(self.tokens_lost),
            "goodput": float(min(1.0, self.train_seconds / wall)), "blocked_s": float(self.blocked_seconds),
        }

    def _summary(self) -> dict[str, Any]:
        """What this daemon did over its lifetime: written as the last metrics event (benchmarks read it)."""
        syncer, stats = self.syncer, self.syncer.stats
        return {**self._progress(), "status": "stopped", "version": self.replica.total_version,
                "versions": [v for v, _, _ in self.replica.identities()], "train_seconds": self.train_seconds,
                "wall_seconds": time.monotonic() - self.started, "rounds": syncer.rounds_done,
                "rounds_skipped": syncer.rounds_skipped, "forks_healed": syncer.forks_healed,
                "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "rejected": stats.rejected,
                "rejected_by_kind": dict(stats.rejected_by_kind), "clipped": stats.clipped}

    def _metric(self, **fields: Any) -> None:
        with self._metrics_lock:
            if self.metrics_file is not None:
                self.metrics_file.write(json.dumps({"time": time.time(), **fields}) + "\n")
                self.metrics_file.flush()

    def _evaluate(self) -> None:
        """Measure θ's held-out loss, if the evaluations so far took no more than ``eval_budget`` of the wall time
        (the first one always runs): on a device every evaluation is time not spent training."""
        budget = self.cfg.eval_budget
        if budget < 1 and self.held_out_loss is not None and self.eval_seconds > budget * (
                time.monotonic() - self.started):
            return
        t0 = time.monotonic()
        self.held_out_loss = self.learner.evaluate(self.held_out)
        self.eval_seconds += time.monotonic() - t0
        self.held_out_step = self.learner.step

    # ---- main ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        self._install_signal_handlers()  # first: a SIGTERM during start-up still means a clean exit 0
        self.device = resolve_device(cfg.device)
        torch.set_num_threads(cfg.threads)
        self.token = self._membership()
        validators = make_validators(cfg.run_id, self.token)
        self.subkey = validators[0].local_public_key
        self.dht = dht = start_dht(cfg, validators)
        try:
            return self._run_with_dht(dht)
        finally:
            dht.shutdown()

    def _run_with_dht(self, dht: DHT) -> int:
        peer_id = str(dht.peer_id)
        log_context.peer = peer_id[-8:]
        for maddr in dht.get_visible_maddrs():
            print(maddr, flush=True)
        logger.info("peer id %s; to join this run: atoll start --initial-peers <one of the lines above>", peer_id)
        self._agree_on_run_config(dht)
        run = self.cfg.run
        tokens, vocab = load_corpus(run.data)
        model_cfg = get_model_config(run.model)
        if vocab > model_cfg.vocab_size:
            raise ConfigError(f"data: tokens go up to {vocab - 1} but model {run.model!r} has vocab {model_cfg.vocab_size}")
        corpus = Corpus(tokens, model_cfg.seq_len, run.num_shards)
        shard = shard_for_peer(peer_id, run.num_shards)
        self.held_out = corpus.held_out(self.cfg.eval_batches, self.cfg.batch_size)
        self.learner = learner = Learner(run, self.device, corpus, shard, self.cfg.batch_size)
        try:
            self.fragments = make_fragments(learner.params, run.num_fragments, run.sync_every,
                                            embedding=learner.model.embed.weight)
        except ValueError as e:
            raise ConfigError(f"fragments: {e}") from None
        # Θ₀ is the learner's initial model: the same seed on every daemon (initialised on the CPU).
        self.replica = Replica([f.gather(learner.params) for f in self.fragments])
        self.local = [LocalFragmentState(f.gather(learner.params), self._replica_id(p))
                      for p, f in enumerate(self.fragments)]
        if self.cfg.checkpoint_dir:
            self.metrics_file = open(Path(self.cfg.checkpoint_dir) / "metrics.jsonl", "a")
            self.checkpointer = CheckpointWriter(self.cfg.checkpoint_dir, lambda meta: self._metric(
                event="checkpoint", version=meta["version"], step=meta["step"], tokens=meta["tokens"]))
        resumed = self._restore()
        self.syncer = syncer = Syncer(self.cfg, dht, self.subkey, self.replica, self._progress, self.fragments,
                                      private=self.token is not None)
        syncer.error_feedback.load_state_dict(self.restored_error_feedback)
        syncer.config_record = self.config_record
        syncer.start()
        if resumed:
            states = syncer.catch_up_now(timeout=max(60.0, 4 * run.round_timeout))
            if states:
                logger.info("caught up on %d fragment(s) to version %d before training", len(states),
                            self.replica.total_version)
                self._metric(event="caught_up", version=self.replica.total_version,
                             fragments=[s.fragment for s in states], donors=[list(s.donors) for s in states])
        else:
            states = syncer.download_initial_state(timeout=max(60.0, 4 * run.round_timeout))
            for p, fragment in enumerate(self.fragments):
                theta_p, base_id = self.replica.params_and_id(p)
                fragment.scatter(theta_p, learner.params)
                self.local[p] = LocalFragmentState(theta_p, base_id)
            if len(states) == len(self.fragments):
                self.replica.schedule_step = states[0].schedule_step
                logger.info("joined at version %d from %s (shard %d)", self.replica.total_version,
                            ", ".join(sorted({d[-8:] for st in states for d in st.donors})), shard)
                self._metric(event="joined", version=self.replica.total_version, donor=states[0].donor,
                             donors=[list(s.donors) for s in states], resumed_bytes=[s.resumed_bytes for s in states],
                             bytes_received=syncer.stats.bytes_received)  # what joining cost: the whole state
            else:
                logger.info("no peer holds state yet: starting from the seed's initial model (shard %d)", shard)
        if run.algorithm == "ddp" and self.replica.total_version > 0 and not resumed:
            raise ConfigError(f"algorithm: ddp runs have a fixed membership and this one is at step "
                              f"{self.replica.total_version}; start every ddp daemon together (see --quorum)")
        self.status = "training"
        try:
            if run.algorithm == "ddp":
                self._wait_for_peers(run.quorum)
            elif "start_together" in self.cfg.parsed_faults():  # tests: every daemon's first step at once
                self._wait_for_peers(self.cfg.parsed_faults()["start_together"])
            self._train()
        finally:
            self.status = "leaving"
            syncer.shutdown()
            self._checkpoint()
            if self.checkpointer is not None:
                self.checkpointer.wait()
            logger.info("stopped at step %d, version %d", learner.step, self.replica.total_version)
            self._metric(event="summary", **self._summary())
            if self.metrics_file is not None:
                self.metrics_file.close()
        return 0

    def _ddp_report(self) -> None:
        """ddp has no outer rounds; every H steps it logs and records its state like one, and checkpoints."""
        learner = self.learner
        version, weight, digest = self.replica.identity(0)
        group = self.syncer.last_group or [str(self.dht.peer_id)]
        self._evaluate()
        logger.info("ddp step %d: version %d, %d members, held-out loss %.4f, hash %s", learner.step, version,
                    len(group), self.held_out_loss, digest)
        self._metric(event="round", fragment=0, version=version, hash=digest, weight=weight, members=group,
                     contributors=group, step=learner.step, tokens=learner.tokens, held_out_loss=self.held_out_loss,
                     held_out_step=self.held_out_step,
                     seconds=0.0, bytes_sent=self.syncer.stats.bytes_sent,
                     bytes_received=self.syncer.stats.bytes_received)
        self._checkpoint()

    def _wait_for_peers(self, count: int) -> None:
        """Hold the first step until ``count`` daemons (this one included) are training (ddp; the
        ``start_together`` fault)."""
        logged = False
        while not self.stop.is_set():
            training = sum(peer.status == "training" for peer in self.syncer.peers().values()) + 1
            if training >= count:
                return
            if not logged:
                logger.info("waiting for %d daemons to start together (%d training)", count, training)
                logged = True
            self.stop.wait(0.2)

    def _replica_id(self, p: int) -> tuple[int, str]:
        version, _, digest = self.replica.identity(p)
        return version, digest

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            logger.info("received %s: finishing the current step, then leaving", signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
        if self.cfg.parsed_faults().get("checkpoint_kill_signal"):

            def arm(_signum: int, _frame: Any) -> None:
                self.checkpoint_kill_armed = True

            signal.signal(signal.SIGUSR1, arm)

    # ---- the training loop ----------------------------------------------------------------------------------
    def _train(self) -> None:
        """The learner's loop: never awaits the network. Rounds run in the syncer; results merge at step
        boundaries. Only the synchronous algorithms (diloco, streaming) block when a merge is due."""
        cfg, learner, run = self.cfg, self.learner, self.cfg.run
        step_delay = cfg.parsed_faults().get("step_delay", 0.0)
        # On an accelerator, reading a step's loss waits for the device to finish that step; the previous step's
        # loss is ready, so the host traces step k+1 while the device runs step k (the reported loss lags a step).
        lagged_loss = self.device.kind != "cpu"
        window_start, window_tokens = time.monotonic(), 0
        self.started = time.monotonic()
        while not self.stop.is_set() and (cfg.max_steps == 0 or learner.step < cfg.max_steps):
            self._apply_adopted()
            t0 = time.monotonic()
            if step_delay:
                time.sleep(step_delay)
            before = learner.step
            if run.algorithm == "ddp":
                self.loss = self._ddp_step()
            elif lagged_loss:
                self.loss = learner.train_step_lagged()
            else:
                self.loss = learner.train_step()
            elapsed_step = time.monotonic() - t0
            self.train_seconds += elapsed_step
            if learner.step == before:  # ddp: the step could not be averaged and was dropped
                continue
            self.syncer.step_time = elapsed_step if not self.syncer.step_time else (
                0.9 * self.syncer.step_time + 0.1 * elapsed_step)
            log_context.step = learner.step
            self.replica.schedule_step += 1
            for local in self.local:
                local.add_step(learner.tokens_per_step)
            window_tokens += learner.tokens_per_step
            elapsed = time.monotonic() - window_start
            if elapsed >= 5.0:
                self.tokens_per_s, window_start, window_tokens = window_tokens / elapsed, time.monotonic(), 0
            if learner.step % 10 == 0:
                self._metric(step=learner.step, tokens=learner.tokens, loss=self.loss)
            if run.algorithm == "ddp":
                if learner.step % run.sync_every == 0:
                    self._ddp_report()
                continue
            for fragment in self.fragments:
                if fragment.due(self.replica.schedule_step, run.sync_every):
                    self._start_round(fragment.index, own_schedule=True)
            if run.algorithm == "decoupled":
                for p in sorted(self.syncer.take_open_rounds()):
                    self._start_round(p)
            self._submit_snapshots()
            self._merge_due()

    def _ddp_step(self) -> float:
        """One data-parallel step: gradients averaged with every peer before the optimizer step (blocking)."""
        learner = self.learner
        loss = learner.backward()
        version = self.replica.identity(0)[0]
        t0 = time.monotonic()
        future = self.syncer.submit_gradient_allreduce(version, learner.flat_grads(), float(learner.tokens_per_step))
        while not future.done() and not self.stop.wait(0.001):
            pass
        self.blocked_seconds += time.monotonic() - t0
        self.train_seconds -= time.monotonic() - t0  # the caller times the whole step; waiting is not training
        averaged = future.result() if future.done() and future.exception() is None else None
        if averaged is None:
            # No group could average this step: stepping alone would fork the replica. Try the batch again.
            learner.discard_step()
            self.ddp_failed_steps += 1
            return loss
        learner.load_flat_grads(averaged)
        learner.apply_step()
        self.replica.replace_params(0, version, learner.flat_params(), learner.tokens_per_step)
        self.local[0].restart(*self.replica.params_and_id(0))
        return loss

    def _apply_adopted(self) -> None:
        for state in self.syncer.take_adopted():
            p = state.fragment
            new, base_id = self.replica.params_and_id(p)
            local, fragment = self.local[p], self.fragments[p]
            # Our merged rounds that the new replica does not descend from were lost with our side of a fork.
            ours = self.merged_rounds.get(p, [])
            lost_rounds = [r for r in ours if r.digest not in state.ancestors] if state.forked else []
            self.merged_rounds[p] = [r for r in ours if r not in lost_rounds]
            lost = sum(r.counters[0] for r in lost_rounds) // len(self.fragments)
            if self.cfg.run.algorithm == "decoupled" and self.cfg.run.stale_contributions:
                # Keep the work no round has merged yet: θ_p moves with the new Θ_p, and the unmerged progress
                # rides along into our next contribution (a stale one, weighted by the tokens behind it). Our part
                # of the lost rounds rides along too (Θ_base − θ_snapshot = delta, so its progress is −delta).
                progress = fragment.gather(self.learner.params) - local.base
                again = [r for r in lost_rounds if r.delta is not None]
                for r in again:
                    progress -= r.delta
                    local.tokens += r.counters[0]
                    local.steps += r.counters[1]
                lost = sum(r.counters[0] for r in lost_rounds if r.delta is None) // len(self.fragments)
                local.rebase(new, base_id)
                fragment.scatter(new + progress, self.learner.params)
                what = "kept" + (" with our part of the lost round" if again else "")
            else:
                lost += local.restart(new, base_id) // len(self.fragments)
                fragment.scatter(new, self.learner.params)
                what = "discarded"
            self.tokens_lost += lost
            how = f" by replaying {len(state.rounds)} rounds" if state.rounds else ""
            logger.info("adopted fragment %d v%d from %s%s%s; unmerged local work %s, %d tokens' work lost", p,
                        state.version, state.donor[-8:], how, " (a fork: ours lost)" if state.forked else "", what,
                        lost)
            self._metric(event="adopted", fragment=p, version=state.version, lost_tokens=lost, step=self.learner.step,
                         forked=state.forked, hash=state.digest, donors=list(state.donors),
                         replayed=len(state.rounds))

    def _start_round(self, p: int, own_schedule: bool = False) -> None:
        """Contribute fragment ``p`` to its next round: at its due step (``own_schedule``), or earlier when a peer
        opened that round (decoupled)."""
        if p in self.pending or p in self.snapshots:  # the previous round has not landed: do not queue another
            if own_schedule:
                self.syncer.rounds_skipped += 1
            return
        run = self.cfg.run
        if own_schedule and run.algorithm == "decoupled" and self.local[p].steps < run.sync_every // 2:
            # We joined a round of p that a peer opened not long ago: opening another now would only split the
            # swarm's work on p into smaller rounds.
            return
        self._apply_adopted()  # the pseudo-gradient must be taken against the replica the round will update
        local = self.local[p]
        version, _, digest = self.replica.identity(p)
        if (version, digest) != local.base_id or local.steps == 0:
            # An adoption is landing right now, or one just restarted this fragment: nothing of ours to merge yet.
            self.syncer.rounds_skipped += 1
            return
        weight = token_weight(local.tokens, local.steps) if run.algorithm == "decoupled" else float(local.tokens)
        # θ_p as of this step, copied to host memory without holding up the next steps (on an accelerator the copy
        # lands a step or two later; the round starts then, against the base it was taken from).
        snapshot = _Snapshot(self.learner.snapshot(self.fragments[p].params), local.base, local.base_id, weight,
                             self.replica.schedule_step + run.overlap_steps)
        self.snapshots[p] = snapshot
        self._submit_snapshots()

    def _submit_snapshots(self) -> None:
        """Start the rounds whose fragment snapshots have reached host memory."""
        run = self.cfg.run
        keep = run.algorithm == "decoupled" and run.stale_contributions
        synchronous = run.algorithm in ("diloco", "streaming")
        for p, snap in list(self.snapshots.items()):
            # A synchronous round merges at a fixed step: training past it on θ_p would be overwritten, so wait.
            if not snap.theta.done() and not (synchronous and self.replica.schedule_step >= snap.merge_at):
                continue
            del self.snapshots[p]
            delta = pseudo_gradient(snap.base, snap.theta.result())
            future = self.syncer.submit_round(p, delta, snap.weight, snap.base_id)
            self.pending[p] = _Pending(future, snap.merge_at, snap.base_id[0], delta.float() if keep else None)

    def _merge_due(self) -> None:
        synchronous = self.cfg.run.algorithm in ("diloco", "streaming")
        for p, pending in list(self.pending.items()):
            if self.replica.schedule_step < pending.merge_at:
                continue
            if not pending.future.done():
                if not synchronous:
                    continue  # decoupled: never wait; merge whenever the round lands
                t0 = time.monotonic()
                while not pending.future.done():
                    if self.stop.wait(0.02):
                        self.blocked_seconds += time.monotonic() - t0
                        return
                self.blocked_seconds += time.monotonic() - t0
            del self.pending[p]
            self._finish_round(p, pending)

    def _finish_round(self, p: int, pending: _Pending) -> None:
        learner, run = self.learner, self.cfg.run
        try:
            outcome = pending.future.result()
        except (concurrent.futures.CancelledError, Exception) as e:  # a round must never end the training loop
            logger.warning("round f%d v%d ended with an error: %r", p, pending.version, e)
            outcome = RoundOutcome("failed", pending.version)
        if outcome.kind == "merged":
            fragment = self.fragments[p]
            merged, base_id = self.replica.params_and_id(p)
            # Overwriting θ_p drops the steps trained on it since the snapshot (the paper's α = 0 choice): τ, or
            # more when the round landed late (a grace window that waited for a joiner).
            since = max(run.overlap_steps, self.replica.schedule_step - (pending.merge_at - run.overlap_steps))
            self.tokens_lost += since * learner.tokens_per_step // len(self.fragments)
            tokens, steps = self.local[p].tokens, self.local[p].steps
            self.local[p].restart(merged, base_id)
            rounds = self.merged_rounds.setdefault(p, [])
            for older in rounds:
                older.delta = None  # memory: only the newest round can be contributed again
            rounds.append(_MergedRound(base_id[1], (tokens, steps), pending.delta))
            del rounds[:-MAX_ANCESTORS]
            if run.alpha:
                merged = run.alpha * fragment.gather(learner.params) + (1 - run.alpha) * merged
            fragment.scatter(merged, learner.params)
            # The round's own result: a heavier replica downloaded since (now in θ_p) is recorded as an adoption.
            ver, w, digest = outcome.version, outcome.weight, outcome.digest
            if p == 0:
                self._evaluate()
            logger.info("round f%d v%d→v%d done in %.1fs: %d members, %d contributors, held-out loss %s, hash %s",
                        p, pending.version, ver, outcome.seconds, len(outcome.members), len(outcome.contributors),
                        f"{self.held_out_loss:.4f}" if self.held_out_loss is not None else "-", digest)
            self._metric(event="round", fragment=p, version=ver, hash=digest, weight=w, members=outcome.members,
                         contributors=outcome.contributors, step=learner.step, tokens=learner.tokens,
                         held_out_loss=self.held_out_loss, held_out_step=self.held_out_step, seconds=outcome.seconds,
                         bytes_sent=self.syncer.stats.bytes_sent, bytes_received=self.syncer.stats.bytes_received)
            if p == len(self.fragments) - 1:
                self._checkpoint()
        elif outcome.kind == "behind":
            logger.info("round f%d v%d abandoned: a heavier replica exists; catching up", p, pending.version)
            if run.algorithm in ("diloco", "streaming"):
                t0 = time.monotonic()
                deadline = t0 + 2 * self.cfg.heartbeat + 2 * run.round_timeout
                while (time.monotonic() < deadline and not self.stop.is_set()
                       and not self.syncer.replica_changed(p, pending.version)):
                    time.sleep(0.02)
                self.blocked_seconds += time.monotonic() - t0
        else:
            logger.warning("round f%d v%d failed; continuing with local progress", p, pending.version)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        """Copy the state to host memory (consistent at this step) and hand it to the background writer."""
        if self.checkpointer is None:
            return
        tensors = dict(self.learner.state_tensors())  # host copies
        tensors.update({f"ef.{k}": v for k, v in self.syncer.error_feedback_state().items()})  # copies
        for p, local in enumerate(self.local):
            tensors.update({k: v.clone() for k, v in local.state_tensors(f"local.{p}").items()})
        versions, weights, digests, ancestors = [], [], [], []
        for p in range(len(self.fragments)):
            snap = self.replica.snapshot(p)
            tensors[f"replica.{p}.params"], tensors[f"replica.{p}.momentum"] = snap.params, snap.momentum
            versions.append(snap.version)
            weights.append(snap.weight)
            digests.append(snap.digest)
            ancestors.append(list(snap.ancestors))
        meta = {
            "run_id": self.cfg.run_id, "peer_id": str(self.dht.peer_id), "run": self.cfg.run.published(),
            "version": sum(versions), "versions": versions, "weights": weights, "digests": digests,
            "ancestors": ancestors,
            "step": self.learner.step, "tokens": self.learner.tokens, "position": self.learner.position,
            "schedule_step": self.replica.schedule_step, "counters": [lo.counters() for lo in self.local],
            "tokens_lost": self.tokens_lost,
        }
        self.checkpoints_written += 1
        faults = self.cfg.parsed_faults()
        doomed = self.checkpoint_kill_armed or faults.get("kill_in_checkpoint") == self.checkpoints_written
        self.checkpointer.submit(tensors, meta, interrupt=self._die_mid_write if doomed else None)

    def _die_mid_write(self, tmp: Path) -> None:
        """Fault injection: a crash while the checkpoint's tensors are only half on disk."""
        size = tmp.stat().st_size
        with open(tmp, "r+b") as f:
            f.truncate(size // 2)
        logger.warning("fault injection: killing this daemon in the middle of checkpoint %d (%s, %d of %d bytes)",
                       self.checkpoints_written, tmp.name, size // 2, size)
        for h in logger.handlers:
            h.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def _restore(self) -> bool:
        if not self.cfg.checkpoint_dir:
            return False
        loaded = load_checkpoint(self.cfg.checkpoint_dir)
        if loaded is None:
            return False
        tensors, meta = loaded
        if meta.get("run") != self.cfg.run.published():
            raise ConfigError(f"checkpoint_dir: {self.cfg.checkpoint_dir!r} holds a checkpoint of a different run config")
        n = len(self.fragments)
        self.replica = Replica([tensors[f"replica.{p}.params"] for p in range(n)],
                               [tensors[f"replica.{p}.momentum"] for p in range(n)], meta["versions"], meta["weights"],
                               meta.get("ancestors"))
        if [d for _, _, d in self.replica.identities()] != meta["digests"]:
            raise ConfigError("checkpoint_dir: the checkpoint's replica does not match its recorded hashes")
        self.learner.load_state_tensors(tensors)
        self.learner.step, self.learner.tokens, self.learner.position = meta["step"], meta["tokens"], meta["position"]
        self.replica.schedule_step = meta["schedule_step"]
        for p, counters in enumerate(meta["counters"]):
            local = self.local[p]
            local.load(tensors, f"local.{p}", counters)
            theta_p, local.base_id = self.replica.params_and_id(p)
            if not torch.equal(local.base, theta_p):  # a merge was still pending: restart from the replica
                local.restart(theta_p, local.base_id)
                self.fragments[p].scatter(theta_p, self.learner.params)
        self.tokens_lost = meta["tokens_lost"]
        self.restored_error_feedback = {k[3:]: v for k, v in tensors.items() if k.startswith("ef.")}
        log_context.step = self.learner.step
        logger.info("resumed from checkpoint: version %d, step %d, data position %d", meta["version"], meta["step"],
                    meta["position"])
        self._metric(event="resumed", version=meta["version"], step=meta["step"], position=meta["position"])
        return True


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


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
