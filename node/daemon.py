"""The daemon: one per island. Joins (or starts) a run, trains, merges through outer rounds, checkpoints.

Lifetime: validate config → start the DHT (retrying bootstrap) → agree on the run's configuration → restore a
checkpoint or download the swarm's state → train in a plain synchronous loop until stopped → announce leaving,
checkpoint, exit 0. The loop never awaits the network; it hands pseudo-gradients to the syncer and picks up
replicas the syncer adopted at step boundaries.
"""

from __future__ import annotations

import json
import logging
import math
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

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus, load_corpus, shard_for_peer
from atoll.models.outer import pseudo_gradient
from atoll.protocols.records import RunConfigRecord, config_key, make_validators, unwrap_subkeys

from .checkpoint import load_checkpoint, save_checkpoint
from .config import ConfigError, NodeConfig, reconcile_run_config
from .device import resolve_device
from .learner import Learner, initial_params
from .log import context as log_context
from .replica import Replica
from .syncer import Syncer

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


class Daemon:
    def __init__(self, cfg: NodeConfig, explicit_run_fields: set[str]) -> None:
        self.cfg, self.explicit = cfg, explicit_run_fields
        self.stop = threading.Event()
        self.status = "joining"
        self.loss: float | None = None
        self.held_out_loss: float | None = None
        self.tokens_per_s = 0.0
        self.steps_since_round = 0
        self.tokens_at_round = 0
        self.metrics_file = None

    # ---- set-up --------------------------------------------------------------------------------------------
    def _agree_on_run_config(self, dht: DHT) -> None:
        """Adopt the run's published config (joiners) or publish ours (the daemon that starts the run)."""
        key = config_key(self.cfg.run_id)
        published = None
        if self.cfg.initial_peers:
            for _ in range(5):
                records = [RunConfigRecord.parse_obj(v) for v in unwrap_subkeys(dht.get(key, latest=True)).values()
                           if isinstance(v, dict) and set(v) == {"fields", "started_by", "started_at"}]
                if records:
                    published = min(records, key=lambda r: r.started_at)
                    break
                time.sleep(1)
        if published is not None:
            run = reconcile_run_config(self.cfg.run, self.explicit, published.fields)
            self.cfg = type(self.cfg)(**{**self.cfg.__dict__, "run": run})
            self.config_record = published.dict()
            logger.info("joined run %r started by %s", self.cfg.run_id, published.started_by[-8:])
        else:
            self.config_record = RunConfigRecord(
                fields=self.cfg.run.published(), started_by=str(dht.peer_id), started_at=float(get_dht_time())
            ).dict()
            logger.info("starting a new run %r", self.cfg.run_id)
        dht.store(key, self.config_record, expiration_time=get_dht_time() + CONFIG_TTL, subkey=self.subkey)

    def _progress(self) -> dict[str, Any]:
        learner = getattr(self, "learner", None)
        return {
            "status": self.status, "device": self.device.describe(), "algorithm": self.cfg.run.algorithm,
            "step": learner.step if learner else 0, "tokens": learner.tokens if learner else 0,
            "tokens_per_s": float(self.tokens_per_s), "loss": _finite_or_none(self.loss),
            "held_out_loss": _finite_or_none(self.held_out_loss),
        }

    def _metric(self, **fields: Any) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"time": time.time(), **fields}) + "\n")
            self.metrics_file.flush()

    # ---- main ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        self.device = resolve_device(cfg.device)
        torch.set_num_threads(cfg.threads)
        signature_validator, schema_validator = make_validators(cfg.run_id)
        self.subkey = signature_validator.local_public_key
        self.dht = dht = start_dht(cfg, [signature_validator, schema_validator])
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
        self.replica = Replica(initial_params(run))
        if self.cfg.checkpoint_dir:
            self.metrics_file = open(Path(self.cfg.checkpoint_dir) / "metrics.jsonl", "a")
        resumed = self._restore()
        self.syncer = syncer = Syncer(self.cfg, dht, self.subkey, self.replica, self._progress)
        syncer.config_record = self.config_record
        syncer.start()
        self._install_signal_handlers()
        if not resumed:
            state = syncer.download_initial_state(timeout=max(60.0, 4 * run.round_timeout))
            if state is not None:
                self._load_replica_into_learner(state.steps_since_round)
                logger.info("joined at version %d from %s (shard %d)", state.version, state.donor[-8:], shard)
                self._metric(event="joined", version=state.version, donor=state.donor)
            else:
                self.learner.load_flat(self.replica.params_copy()[0])
                logger.info("no peer holds state yet: starting from the seed's initial model (shard %d)", shard)
        self.status = "training"
        try:
            self._train()
        finally:
            self.status = "leaving"
            syncer.shutdown()
            self._checkpoint()
            logger.info("stopped at step %d, version %d", learner.step, self.replica.identity[0])
        return 0

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            logger.info("received %s: finishing the current step, then leaving", signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def _load_replica_into_learner(self, steps_since_round: int) -> None:
        params, _ = self.replica.params_copy()
        self.learner.load_flat(params)
        self.steps_since_round = steps_since_round
        self.replica.steps_since_round = steps_since_round
        self.tokens_at_round = self.learner.tokens

    # ---- the training loop ----------------------------------------------------------------------------------
    def _train(self) -> None:
        cfg, learner = self.cfg, self.learner
        step_delay = cfg.parsed_faults().get("step_delay", 0.0)
        window_start, window_tokens = time.monotonic(), 0
        while not self.stop.is_set() and (cfg.max_steps == 0 or learner.step < cfg.max_steps):
            adopted = self.syncer.take_adopted()
            if adopted is not None:
                lost = learner.tokens - self.tokens_at_round
                self._load_replica_into_learner(adopted.steps_since_round)
                logger.info("adopted replica v%d from %s; %d local tokens discarded", adopted.version,
                            adopted.donor[-8:], lost)
                self._metric(event="adopted", version=adopted.version, lost_tokens=lost, step=learner.step)
            if step_delay:
                time.sleep(step_delay)
            self.loss = learner.train_step()
            log_context.step = learner.step
            self.steps_since_round += 1
            self.replica.steps_since_round = self.steps_since_round
            window_tokens += learner.tokens_per_step
            elapsed = time.monotonic() - window_start
            if elapsed >= 5.0:
                self.tokens_per_s, window_start, window_tokens = window_tokens / elapsed, time.monotonic(), 0
            if learner.step % 10 == 0:
                self._metric(step=learner.step, tokens=learner.tokens, loss=self.loss)
            if self.steps_since_round >= cfg.run.sync_every:
                self._outer_round()

    def _outer_round(self) -> None:
        learner, run = self.learner, self.cfg.run
        theta, version = self.replica.params_copy()
        delta = pseudo_gradient(theta, learner.flat_params())
        weight = float(learner.tokens - self.tokens_at_round)
        future = self.syncer.submit_round(delta, weight)
        while not future.done():
            if self.stop.wait(0.05):
                logger.info("leaving during round v%d", version)
                return
        outcome = future.result()
        if outcome.kind == "merged":
            self._load_replica_into_learner(0)
            self.held_out_loss = learner.evaluate(self.held_out)
            ver, w, digest = self.replica.identity
            logger.info("round v%d→v%d done in %.1fs: %d members, %d contributors, held-out loss %.4f, hash %s",
                        version, ver, outcome.seconds, len(outcome.members), len(outcome.contributors),
                        self.held_out_loss, digest)
            self._metric(event="round", version=ver, hash=digest, weight=w, members=outcome.members,
                         contributors=outcome.contributors, step=learner.step, tokens=learner.tokens,
                         held_out_loss=self.held_out_loss, seconds=outcome.seconds,
                         bytes_sent=self.syncer.stats.bytes_sent, bytes_received=self.syncer.stats.bytes_received)
            self._checkpoint()
        elif outcome.kind == "behind":
            logger.info("round v%d abandoned: a heavier replica exists; catching up", version)
            deadline = time.monotonic() + 2 * self.cfg.heartbeat + 2 * run.round_timeout
            while time.monotonic() < deadline and not self.stop.is_set() and not self.syncer.replica_changed(version):
                time.sleep(0.05)
        else:
            logger.warning("round v%d failed; continuing with local progress", version)
            self.steps_since_round = 0

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        if not self.cfg.checkpoint_dir:
            return
        snap = self.replica.snapshot()
        tensors = {"replica.params": snap.params, "replica.momentum": snap.momentum, **self.learner.state_tensors()}
        meta = {
            "run_id": self.cfg.run_id, "peer_id": str(self.dht.peer_id), "run": self.cfg.run.published(),
            "version": snap.version, "weight": snap.weight, "digest": snap.digest, "step": self.learner.step,
            "tokens": self.learner.tokens, "position": self.learner.position,
            "steps_since_round": self.steps_since_round, "tokens_at_round": self.tokens_at_round,
        }
        save_checkpoint(self.cfg.checkpoint_dir, tensors, meta)

    def _restore(self) -> bool:
        if not self.cfg.checkpoint_dir:
            return False
        loaded = load_checkpoint(self.cfg.checkpoint_dir)
        if loaded is None:
            return False
        tensors, meta = loaded
        if meta.get("run") != self.cfg.run.published():
            raise ConfigError(f"checkpoint_dir: {self.cfg.checkpoint_dir!r} holds a checkpoint of a different run config")
        self.replica = Replica(tensors["replica.params"], tensors["replica.momentum"], meta["version"], meta["weight"])
        if self.replica.digest != meta["digest"]:
            raise ConfigError("checkpoint_dir: the checkpoint's replica does not match its recorded hash")
        self.learner.load_state_tensors(tensors)
        self.learner.step, self.learner.tokens, self.learner.position = meta["step"], meta["tokens"], meta["position"]
        self.steps_since_round = self.replica.steps_since_round = meta["steps_since_round"]
        self.tokens_at_round = meta["tokens_at_round"]
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
