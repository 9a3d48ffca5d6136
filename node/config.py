"""Typed, validated configuration: defaults < TOML file < command-line flags.

``RunConfig`` is what every daemon of a run must agree on; the daemon that starts a run publishes it in the DHT
and joiners adopt it (and refuse to start if one of their explicitly set fields disagrees). ``NodeConfig`` is
local to one daemon. Every problem raises ``ConfigError`` with one line that names the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from multiaddr import Multiaddr

from atoll.models.configs import MODELS
from atoll.protocols.codecs import CODECS

ALGORITHMS = ("decoupled", "streaming", "diloco", "ddp")
DEVICES = ("auto", "cpu", "cuda", "xla")
FAULTS = {"kill_in_round": int, "step_delay": float, "corrupt_round": int, "split_side": int, "split_until": int,
          "byzantine": str, "byzantine_from": int, "start_together": int, "kill_in_checkpoint": int,
          "checkpoint_kill_signal": int}
BYZANTINE = ("scale", "nan", "shape")


class ConfigError(ValueError):
    """Bad configuration; the CLI prints it as one line and exits with code 2."""


@dataclass(frozen=True)
class RunConfig:
    """Shared by every daemon of a run (published in the DHT by the daemon that starts the run)."""

    model: str = "tiny"
    algorithm: str = "decoupled"
    data: str = "builtin"
    sync_every: int = 50  # H: inner steps between outer rounds
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    seed: int = 0
    num_shards: int = 16
    gather_timeout: float = 30.0  # seconds a round waits for expected members
    round_timeout: float = 30.0  # seconds a reducer waits for missing parts
    # streaming / decoupled (diloco always uses one fragment, no overlap, every live member):
    fragments: int = 4  # P
    overlap: int = 2  # τ: inner steps between a fragment's snapshot and its merge
    alpha: float = 0.0  # merge θ ← α·θ + (1−α)·Θ
    quorum: int = 1  # K: minimum members before a round may close (decoupled); ddp: daemons that start together
    max_group: int = 16  # round-size cap: more ready daemons form several groups (forks that consistency heals)
    grace_gamma: float = 0.5  # γ < 1: share of the overlap's slack a round may wait for more members
    # decoupled, γ > 0: the grace window is at least the time a peer needs to notice a round another daemon opened
    # and register for it (atoll.models.outer.join_window); without it, at τ·step_time below a second, rounds close
    # before a peer a few steps off its schedule has joined, and the peers left out drop their unmerged work.
    join_window: bool = True
    stale_contributions: bool = False  # decoupled: keep work a round missed and contribute it to the next one
    rda: bool = True  # radial-directional averaging for non-embedding fragments (decoupled)
    # Codec of outer deltas on the wire (atoll.protocols.codecs). int4 with error feedback measured at parity with
    # fp32 (held-out loss 0.990x over three seeds) for 7.5x fewer bytes: docs/results/..._decoupled_h160.json.
    compression: str = "int4"
    error_feedback: bool = True  # keep what quantization dropped and add it to the next delta
    codec_block: int = 256  # values per scale in the blockwise codecs
    # Robust merging: a reducer treats every contribution (and declared weight or RDA norm) above clip_factor × the
    # round's lower median as an outlier and scales it to the lower median (atoll.models.robust); 0 disables.
    # Measured: honest shard contributions of a decoupled swarm with a 3× slower daemon were within 2× the lower
    # median in 98% of cases, at most 4.7×, so 4 leaves honest spread alone; an attacker that stays just below it
    # weighs at most 4 typical members (keep it small: cut to 4× rather than to the median, a ×1000 member of four
    # cost the honest daemons up to 7% held-out loss, and 22% at 8×; unclipped, ×340).
    clip_factor: float = 4.0

    def validate(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"model: unknown {self.model!r}; known: {', '.join(MODELS)}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm: unknown {self.algorithm!r}; known: {', '.join(ALGORITHMS)}")
        if self.data != "builtin" and not Path(self.data).exists():
            raise ConfigError(f"data: {self.data!r} is neither 'builtin' nor an existing path")
        _positive(self, "sync_every", "num_shards", "outer_lr", "inner_lr", "gather_timeout", "round_timeout",
                  "fragments", "quorum", "max_group")
        _non_negative(self, "warmup_steps", "weight_decay", "seed", "overlap")
        if not 0 <= self.alpha < 1:
            raise ConfigError(f"alpha: must be in [0, 1), got {self.alpha}")
        if not 0 <= self.grace_gamma < 1:
            raise ConfigError(f"grace_gamma: must be in [0, 1), got {self.grace_gamma}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum: must be in [0, 1), got {self.outer_momentum}")
        if self.compression not in CODECS:
            raise ConfigError(f"compression: unknown codec {self.compression!r}; known: {', '.join(CODECS)}")
        if self.codec_block <= 0 or self.codec_block % 4:
            raise ConfigError(f"codec_block: must be a positive multiple of 4, got {self.codec_block}")
        factor = self.clip_factor
        if not (isinstance(factor, (int, float)) and (factor == 0 or 1 <= factor < math.inf)):
            raise ConfigError(f"clip_factor: must be 0 (off) or a finite number >= 1, got {self.clip_factor!r}")
        if self.overlap >= self.sync_every:
            raise ConfigError(f"overlap: must be smaller than sync_every ({self.sync_every}), got {self.overlap}")

    @property
    def num_fragments(self) -> int:
        return 1 if self.algorithm in ("diloco", "ddp") else self.fragments

    @property
    def overlap_steps(self) -> int:
        return 0 if self.algorithm in ("diloco", "ddp") else self.overlap

    def published(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class NodeConfig:
    """Local to one daemon."""

    run: RunConfig = field(default_factory=RunConfig)
    run_id: str = "atoll"
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity: str | None = None
    checkpoint_dir: str | None = None
    device: str = "auto"
    batch_size: int = 8
    threads: int = 1
    max_steps: int = 0  # 0: train until stopped
    heartbeat: float = 2.0  # seconds between progress records
    eval_batches: int = 8
    # The share of wall time the held-out evaluation may take: it runs after a merge (and once at the end) only
    # while the time spent on it so far is within this share, so it never costs training more than that.
    # 1 evaluates after every merge.
    eval_budget: float = 0.01
    bootstrap_retries: int = 3
    log_level: str = "INFO"
    # Seconds a peer whose part, record or state this daemon rejected is left out: its progress record is ignored,
    # so it is not counted live, expected, registered or a donor in rounds this daemon forms, and its parts are
    # treated as missing in the shards this daemon reduces. Long enough to outlast a few rounds of a misbehaving
    # peer, short enough that a peer that was wrongly suspected (or fixed) is back within minutes.
    peer_cooldown: float = 120.0
    # Access (see atoll.protocols.auth). A new run is private unless ``open``: its run key is created at ``run_key``
    # (default <checkpoint_dir>/run.key); joiners of a private run present a ``join_token`` file.
    open: bool = False
    join_token: str | None = None
    run_key: str | None = None
    # Deterministic fault injection for tests: "kill_in_round=N" SIGKILLs this daemon's process group after the
    # group of its N-th round formed; "step_delay=S" sleeps S seconds per inner step (a slow daemon);
    # "corrupt_round=N" sends malformed parts (truncated, bad header, unknown codec, NaN; each until it has
    # reached two completed rounds) from the N-th multi-member round on; "split_side=S" with "split_until=N"
    # partitions the swarm: until step N a daemon sees and meets only daemons of the same side S (a split swarm
    # whose halves meet again later);
    # "byzantine=K" (scale, nan, shape) makes this daemon a hostile member from its multi-member round
    # "byzantine_from=N" on (default 1): "scale" sends its delta ×1000, "nan" parts holding NaN, "shape" parts
    # of the wrong size (it still reduces its own shard honestly); "start_together=N" holds the first step until N
    # daemons train (a barrier: runs that must be compared step for step start in lockstep, whoever booted first);
    # "kill_in_checkpoint=N" SIGKILLs the process group in the middle of its N-th checkpoint write (the tensors'
    # temporary file half written); "checkpoint_kill_signal=1" makes SIGUSR1 arm the same crash for the next
    # checkpoint write (scripts/chaos.py).
    faults: tuple[str, ...] = ()

    def validate(self) -> None:
        self.run.validate()
        if not self.run_id.replace("-", "").replace("_", "").isalnum() or len(self.run_id) > 64:
            raise ConfigError(f"run_id: {self.run_id!r} must be 1-64 letters, digits, '-' or '_'")
        if self.device not in DEVICES:
            raise ConfigError(f"device: unknown {self.device!r}; use one of {', '.join(DEVICES)}")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for addr in getattr(self, name):
                _check_maddr(name, addr, need_peer_id=name == "initial_peers")
        _positive(self, "batch_size", "threads", "heartbeat", "bootstrap_retries", "eval_batches")
        _non_negative(self, "max_steps", "peer_cooldown")
        if not 0 < self.eval_budget <= 1:
            raise ConfigError(f"eval_budget: {self.eval_budget} must be in (0, 1]")
        if self.identity is not None and not Path(self.identity).parent.is_dir():
            raise ConfigError(f"identity: directory of {self.identity!r} does not exist")
        if self.checkpoint_dir is not None:
            try:
                Path(self.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"checkpoint_dir: cannot create {self.checkpoint_dir!r}: {e.strerror}") from None
        if self.join_token is not None and not Path(self.join_token).is_file():
            raise ConfigError(f"join_token: file {self.join_token!r} does not exist")
        if self.run_key is not None and not Path(self.run_key).parent.is_dir():
            raise ConfigError(f"run_key: directory of {self.run_key!r} does not exist")
        if self.join_token is not None and self.run_key is not None:
            raise ConfigError("join_token: give either a join token or a run key, not both")
        if self.open and (self.join_token is not None or self.run_key is not None):
            raise ConfigError("open: an open run takes no join token or run key")
        self.parsed_faults()
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: unknown {self.log_level!r}")

    def parsed_faults(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in self.faults:
            name, _, value = item.partition("=")
            if name not in FAULTS or not value:
                raise ConfigError(f"faults: unknown fault {item!r}; known: {', '.join(f'{k}=...' for k in FAULTS)}")
            try:
                out[name] = FAULTS[name](value)
            except ValueError:
                raise ConfigError(f"faults: bad value in {item!r}") from None
            if name == "byzantine" and value not in BYZANTINE:
                raise ConfigError(f"faults: unknown byzantine kind {value!r}; known: {', '.join(BYZANTINE)}")
        return out

    @property
    def run_key_path(self) -> str | None:
        """Where this daemon's run key is (or would be created): ``run_key``, else in the checkpoint directory."""
        if self.run_key is not None:
            return self.run_key
        if self.checkpoint_dir is not None:
            return os.path.join(self.checkpoint_dir, "run.key")
        return None

    @property
    def identity_path(self) -> str | None:
        if self.identity is not None:
            return self.identity
        if self.checkpoint_dir is not None:  # a restarted daemon keeps its peer id and therefore its data shard
            return os.path.join(self.checkpoint_dir, "identity.key")
        return None


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}: must be a positive number, got {value!r}")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name}: must be a non-negative number, got {value!r}")


def _check_maddr(name: str, addr: str, need_peer_id: bool) -> None:
    try:
        maddr = Multiaddr(addr)
    except Exception as e:  # the multiaddr package raises several exception types
        raise ConfigError(f"{name}: malformed multiaddr {addr!r} ({e})") from None
    if need_peer_id and "/p2p/" not in str(maddr):
        raise ConfigError(f"{name}: {addr!r} lacks the /p2p/<peer id> part (copy a line that `atoll start` printed)")


RUN_FIELDS = {f.name: f.type for f in fields(RunConfig)}
NODE_FIELDS = {f.name for f in fields(NodeConfig)} - {"run"}


def _coerce(name: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if isinstance(default, tuple):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings, got {value!r}")
        return tuple(value)
    if default is None or isinstance(default, str):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    if isinstance(default, int) and not isinstance(value, bool) and isinstance(value, int):
        return value
    if isinstance(default, float) and not isinstance(value, bool) and isinstance(value, (int, float)):
        return float(value)
    if isinstance(default, (int, float)) and isinstance(value, str):
        try:
            return type(default)(value)
        except ValueError:
            pass
    raise ConfigError(f"{name}: expected a {type(default).__name__}, got {value!r}")


def load_config(overrides: dict[str, Any], toml_path: str | None = None) -> tuple[NodeConfig, set[str]]:
    """Build a validated ``NodeConfig`` from an optional TOML file and flag overrides (None means unset).

    TOML keys are the field names of ``NodeConfig`` and ``RunConfig`` (flat, or run fields under ``[run]``).
    Returns the config and the names of the run fields the user set explicitly (checked against the run's).
    """
    values: dict[str, Any] = {}
    if toml_path is not None:
        try:
            with open(toml_path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config: file {toml_path!r} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {toml_path!r} is not valid TOML ({e})") from None
        run_section = data.pop("run", {})
        if not isinstance(run_section, dict):
            raise ConfigError("config: [run] must be a table")
        values.update(data)
        values.update(run_section)
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - set(RUN_FIELDS) - NODE_FIELDS
    if unknown:
        raise ConfigError(f"config: unknown key(s) {', '.join(sorted(unknown))}")
    run_defaults, node_defaults = RunConfig(), NodeConfig()
    run_kwargs = {k: _coerce(k, v, getattr(run_defaults, k)) for k, v in values.items() if k in RUN_FIELDS}
    node_kwargs = {k: _coerce(k, v, getattr(node_defaults, k)) for k, v in values.items() if k in NODE_FIELDS}
    for name in ("identity", "join_token", "run_key"):
        if node_kwargs.get(name) is not None:
            node_kwargs[name] = os.path.abspath(node_kwargs[name])
    cfg = NodeConfig(run=RunConfig(**run_kwargs), **node_kwargs)
    cfg.validate()
    return cfg, set(run_kwargs)


def reconcile_run_config(local: RunConfig, explicit: set[str], published: dict[str, Any]) -> RunConfig:
    """Adopt the run's published config; raise ``ConfigError`` if a field the user set explicitly disagrees."""
    unknown = set(published) - set(RUN_FIELDS)
    if unknown:
        raise ConfigError(f"run config: the run uses fields this version does not know: {', '.join(sorted(unknown))}")
    conflicts = [
        f"{k}={getattr(local, k)!r} (run has {published[k]!r})"
        for k in sorted(explicit)
        if k in published and getattr(local, k) != published[k]
    ]
    if conflicts:
        raise ConfigError("run config disagrees with the run's: " + ", ".join(conflicts))
    merged = {**dataclasses.asdict(local), **published}
    cfg = RunConfig(**{k: _coerce(k, v, getattr(local, k)) for k, v in merged.items()})
    cfg.validate()
    return cfg
