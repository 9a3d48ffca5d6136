"""Typed, validated configuration: defaults < TOML file < command-line flags.

``NodeConfig`` is local to one daemon; its ``run`` is the ``RunConfig`` every daemon of a run must agree on
(``run_config.py``): the daemon that starts a run publishes it in the DHT and joiners adopt it, refusing to start if
one of their explicitly set fields disagrees (``reconcile_run_config``). ``load_config`` reads both from a TOML file
and the command line. Every problem raises ``ConfigError`` with one line that names the field.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .algorithm import SnapshotAt
from .checks import DEFAULT_RUN_ID, check_maddr, check_run_id
from .faults import parse_faults
from .harness import Harness
from .pause_specs import Mode, PolicyError, check_spec, deadline_of, parse_window
from .run_config import DEVICES, LOCAL_DATA, OWN_MODEL, ConfigError, RunConfig, require_non_negative, require_positive, opt

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its terminating zero


def check_socket_path(path: str) -> None:
    """``ConfigError`` if ``path`` is too long for a Unix socket (``--control-socket``)."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"control_socket: {path!r} is longer than a Unix socket's {MAX_SOCKET_PATH} bytes; give "
                          "a shorter --control-socket")


@dataclass(frozen=True)
class NodeConfig:
    """Local to one daemon."""

    run: RunConfig = field(default_factory=RunConfig)
    run_id: str = opt(DEFAULT_RUN_ID, help="name of the run: 1-64 letters, digits, '-' or '_'")
    initial_peers: tuple[str, ...] = opt((), help="multiaddrs of daemons already in the run; none starts a new run",
                                         metavar="MADDR")
    host_maddrs: tuple[str, ...] = opt(("/ip4/0.0.0.0/tcp/0",), help="multiaddrs to listen on", metavar="MADDR")
    announce_maddrs: tuple[str, ...] = opt((), help="addresses to tell other peers", metavar="MADDR")
    # Behind NAT nothing can dial us: streams reach us only over connections we opened (docs/wan.md, Behind NAT).
    dht_in_process: bool = opt(False, help="run this daemon's DHT node on a thread of its own process instead of "
                                           "hivemind's forked DHT process: one process and its pages fewer; the "
                                           "node's work shares the daemon's interpreter (docs/results.md)")
    client_mode: bool = opt(False, help="this daemon accepts no inbound connections (behind NAT): it joins through "
                                        "--initial-peers, keeps its DHT node out of others' routing tables, and "
                                        "contributes to rounds without reducing a shard or serving state",
                            switch=True)
    identity: str | None = opt(None, help="private key file that keeps the peer id stable across restarts; unset: "
                                          "<checkpoint-dir>/identity.key, or a new id without a checkpoint dir",
                               metavar="PATH")
    checkpoint_dir: str | None = opt(None, help="where checkpoints and metrics.jsonl are written", metavar="DIR")
    device: str = opt("auto", help="device of the inner steps", known=DEVICES)
    precision: str = opt("auto", help="compute precision of the inner steps: bf16 autocast (bf16 matmuls; fp32 "
                                      "master weights, optimizer state and loss) or fp32; auto: bf16 on cuda and xla, "
                                      "fp32 on the cpu", known=("auto", "fp32", "bf16"))
    batch_size: int = opt(8, help="sequences per inner step on this daemon", metavar="N")
    threads: int = opt(1, help="torch CPU threads", metavar="N")
    # Local: when this daemon snapshots its part changes no replica, so daemons of one run may differ.
    snapshot_at: str = opt("formation", help="decoupled: when a round snapshots the fragment, 'formation' (once its "
                                             "group has formed: only the reduce is in flight) or 'due' (at the due "
                                             "step, before the group forms)", known=tuple(SnapshotAt))
    codec_threads: int = opt(0, help="threads that one encode or decode of a large delta may use; 0: 1 on the cpu "
                                     "device (the cores train), else up to 8 (the host's cores are free)", metavar="N")
    grad_accum: int = opt(1, help="micro-batches of --batch-size per inner step on each rank (gradient "
                                  "accumulation); with the run's --global-batch, derived from it", metavar="N")
    # An island of several processes (node/island/ranks.py, docs/design.md): torch's elastic launcher starts them.
    nproc_per_node: int = opt(1, help="ranks of this island on this host, one per accelerator (or per CPU "
                                      "process): more than one launches them with torch's elastic launcher "
                                      "(torchrun); under torchrun itself, leave it unset", metavar="N")
    nnodes: str = opt("1", help="hosts of this island, N or MIN:MAX (torchrun's --nnodes); more than one needs "
                                "--rdzv-endpoint", metavar="N")
    rdzv_endpoint: str = opt("", help="HOST:PORT where this island's hosts meet (torchrun's c10d rendezvous); "
                                      "unset: this host alone", metavar="HOST:PORT")
    # One process driving all of a host's XLA chips (node/spmd.py, docs/xla.md).
    spmd_devices: int = opt(0, help="on --device xla: train as one SPMD program over this many of the host's "
                                    "devices, θ and the AdamW state sharded over them and --batch-size sequences "
                                    "per device; 0: one device", metavar="N")
    fsdp: bool = opt(False, help="an island of several ranks shards θ and the AdamW state over them (FSDP2 "
                                 "fully_shard), so that a model larger than one rank's memory trains; else every "
                                 "rank holds all of them (data parallel)", switch=True)
    max_restarts: int = opt(3, help="times the launcher restarts the island's ranks after one fails (each restart "
                                    "resumes from the checkpoint)", metavar="N")
    max_steps: int = opt(0, help="stop after this many inner steps; 0 trains until stopped", metavar="N")
    # Lending the machine (node/island/pause.py, docs/operations.md "Spare capacity").
    pause_when: tuple[str, ...] = opt((), help="pause (free the accelerator, stay in the run) while this holds: busy "
                                               "(another process uses the GPU, by NVML; else the host's CPU: "
                                               "busy:CORES), or file:PATH (the file exists); repeatable",
                                      metavar="POLICY", repeat=True)
    schedule: str = opt("", help="train only inside this window of local time, HH:MM-HH:MM (may cross midnight); "
                                 "paused outside it", metavar="WINDOW")
    resume_after: float = opt(60.0, help="seconds a --pause-when policy must have stopped holding before the daemon "
                                         "resumes", metavar="S")
    pause_to: str = opt("host", help="where a paused daemon keeps the model and optimizer state while the "
                                     "accelerator is free: host memory, or its checkpoint (frees host memory too; "
                                     "needs --checkpoint-dir)", known=tuple(Mode))
    control_socket: str | None = opt(None, help="Unix socket for atoll pause / atoll resume (the local operator "
                                                "only); unset: <checkpoint-dir>/control.sock, or none without a "
                                                "checkpoint dir", metavar="PATH")
    max_hours: float = opt(0.0, help="leave the run (checkpoint, announce) after this many hours, paused time "
                                     "included; 0: no limit", metavar="H")
    until: str = opt("", help="leave the run at this local time: HH:MM (its next occurrence) or an ISO date and "
                              "time", metavar="TIME")
    tensorboard: str | None = opt(None, help="also log the figures of the progress record (loss, held-out loss, "
                                             "tokens/s, rounds, bytes, tokens lost and carried) to TensorBoard under "
                                             "DIR/<run id>/<peer id> (the extra atoll[tensorboard])", metavar="DIR")
    wandb: str | None = opt(None, help="also log them to this Weights & Biases project, one run per daemon grouped "
                                       "by the run id (the extra atoll[wandb]; WANDB_MODE=offline honoured)",
                            metavar="PROJECT")
    wandb_name: str | None = opt(None, help="the W&B run's name (default: <run id>-<peer id's last 8>)",
                                 metavar="NAME")
    heartbeat: float = opt(2.0, help="seconds between progress records (at least; up to a quarter of a round, at "
                                     "most 60 s, when a decoupled daemon's rounds are slower)", metavar="S")
    eval_batches: int = opt(8, help="held-out batches per evaluation", metavar="N")
    eval_budget: float = opt(0.01, help="share of wall time the held-out evaluation may take, in (0, 1]: it runs "
                                        "after a merge (and once at the end) only while the time spent on it so far "
                                        "is within this share; 1 evaluates after every merge", metavar="SHARE")
    bootstrap_retries: int = opt(3, help="attempts to start the DHT and reach an initial peer", metavar="N")
    config_wait: float = opt(30.0, help="seconds a daemon given --initial-peers waits to read the run's config "
                                        "before it gives up (it never starts a new run at someone else's peers)",
                             metavar="SECONDS")
    new_run: bool = opt(False, help="with --initial-peers (a shared DHT, a bootstrap node): start the run there if it "
                                     "is not found at once, instead of waiting for it; join it if it is", switch=True)
    state_wait: float = opt(600.0, help="seconds a newcomer waits for a live holder of the run's state when the run "
                                        "already got somewhere and none is live; then it exits 2", metavar="SECONDS")
    restart_run: bool = opt(False, help="a newcomer that finds no live holder of the run's state starts the run over "
                                        "from the seed's initial model instead of waiting", switch=True)
    log_level: str = opt("INFO", help="DEBUG, INFO, WARNING or ERROR", metavar="LEVEL")
    log_format: str = opt("text", help="log lines as text, or as JSON objects (time, level, peer_id, step, message) "
                                       "for log shippers", known=("text", "json"))
    metrics_port: int = opt(-1, help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics "
                                     "(docs/operations.md); 0: a free port, logged; -1: none", metavar="PORT")
    metrics_host: str = opt("127.0.0.1", help="address the metrics endpoint listens on; 0.0.0.0 for a Prometheus on "
                                              "another host", metavar="ADDR")
    # Long enough to outlast a few rounds of a misbehaving peer, short enough that a peer that was wrongly suspected
    # (or fixed) is back within minutes.
    peer_cooldown: float = opt(120.0, help="seconds a peer whose part, record or state this daemon rejected is left "
                                           "out: not counted live, expected, registered or a donor in rounds this "
                                           "daemon forms, and its parts treated as missing in the shards it reduces",
                               metavar="S")
    # Two: one lying member alone cannot make the others adopt a state (a replica it made up); fewer live peers than
    # this and every one of them must agree.
    state_vouchers: int = opt(2, help="distinct live peers that must hold a replica before this daemon downloads and "
                                      "adopts it (all of them when fewer are live)", metavar="N")
    # Access (see atoll.protocols.auth).
    open: bool = opt(False, help="start an open run that any daemon may join; else a new run is private",
                     switch=True)
    join_token: str | None = opt(None, help="membership of a private run, issued with `atoll token`",
                                 metavar="FILE")
    run_key: str | None = opt(None, help="run key of a private run, created when starting a new run; unset: "
                                         "<checkpoint-dir>/run.key", metavar="FILE")
    # Deterministic fault injection for tests and scripts/chaos.py: the kinds are listed in atoll.node.faults.
    faults: tuple[str, ...] = opt((), help="deterministic fault injection for tests", metavar="NAME=VALUE",
                                  repeat=True, flag="--fault", hidden=True)
    # Benchmarks' and tests' settings that make runs compare (a step delay, a common start): atoll.node.harness.
    harness: tuple[str, ...] = opt((), help="settings of a benchmark or test harness", metavar="NAME=VALUE",
                                   repeat=True, hidden=True)

    def validate(self) -> None:
        self.run.validate()
        check_run_id(self.run_id)
        if self.snapshot_at not in tuple(SnapshotAt):
            raise ConfigError(f"snapshot_at: unknown {self.snapshot_at!r}; known: {', '.join(SnapshotAt)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device: unknown {self.device!r}; use one of {', '.join(DEVICES)}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"precision: unknown {self.precision!r}; use auto, fp32 or bf16")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for addr in getattr(self, name):
                check_maddr(name, addr, need_peer_id=name == "initial_peers")
        if self.client_mode and not self.initial_peers:
            raise ConfigError("client_mode: a daemon nobody can dial cannot start a run; pass --initial-peers of a "
                              "reachable daemon of the run")
        require_positive(self, "batch_size", "threads", "heartbeat", "bootstrap_retries", "eval_batches", "config_wait",
                  "state_wait", "state_vouchers")
        require_non_negative(self, "max_steps", "peer_cooldown", "max_restarts", "codec_threads")
        require_positive(self, "grad_accum", "nproc_per_node")
        require_non_negative(self, "spmd_devices")
        if self.spmd_devices and self.device != "xla":
            raise ConfigError(f"spmd_devices: SPMD shards the learner over XLA devices; it needs --device xla, "
                              f"not {self.device}")
        if self.spmd_devices and self.nproc_per_node > 1:
            raise ConfigError("spmd_devices: an SPMD island is one process driving the host's devices; leave "
                              "--nproc-per-node unset")
        low, _, high = self.nnodes.partition(":")
        if not (low.isdigit() and int(low) >= 1 and (not high or (high.isdigit() and int(high) >= int(low)))):
            raise ConfigError(f"nnodes: expected N or MIN:MAX, got {self.nnodes!r}")
        if (high or int(low) > 1) and not self.rdzv_endpoint:
            raise ConfigError("rdzv_endpoint: an island of several hosts needs HOST:PORT where they meet")
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"rdzv_endpoint: expected HOST:PORT, got {self.rdzv_endpoint!r}")
        if self.heartbeat > 200:  # a progress record lives 3 heartbeats; the DHT caps it at 10 min
            raise ConfigError(f"heartbeat: at most 200 s, got {self.heartbeat}")
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
        self.parsed_harness()
        self._check_lending()
        if self.tensorboard is not None and not self.tensorboard.strip():
            raise ConfigError("tensorboard: name the directory to write TensorBoard's event files in")
        for name in ("wandb", "wandb_name"):
            value = getattr(self, name)
            if value is not None and (not 0 < len(value) <= 128 or any(c in value for c in "/\\#?%:")):
                raise ConfigError(f"{name}: 1-128 characters without / \\ # ? % :, got {value!r}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} must be a port (0: a free one) or -1 (none)")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format: unknown {self.log_format!r}; use text or json")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: unknown {self.log_level!r}")

    def _check_lending(self) -> None:
        checks = [("pause_when", lambda spec=spec: check_spec(spec)) for spec in self.pause_when]
        checks += [("schedule", lambda: self.schedule and parse_window(self.schedule)),
                   ("until", lambda: deadline_of(0, self.until))]
        for name, check in checks:
            try:
                check()
            except PolicyError as e:
                raise ConfigError(f"{name}: {e}") from None
        require_non_negative(self, "resume_after", "max_hours")
        if self.pause_to not in tuple(Mode):
            raise ConfigError(f"pause_to: unknown {self.pause_to!r}; use {' or '.join(Mode)}")
        if self.pause_to == "checkpoint" and self.checkpoint_dir is None:
            raise ConfigError("pause_to: checkpoint keeps a paused daemon's state in its checkpoint; give "
                              "--checkpoint-dir")
        if (self.pause_when or self.schedule) and self.nproc_per_node > 1:
            raise ConfigError("pause_when: an island of several ranks cannot pause yet; run one daemon per "
                              "accelerator to lend them one by one")
        if self.control_socket is not None:
            check_socket_path(self.control_socket)

    @property
    def control_path(self) -> str | None:
        """The control socket's path (``--control-socket``, else the checkpoint dir's ``control.sock``)."""
        if self.control_socket:
            return self.control_socket
        return os.path.join(self.checkpoint_dir, "control.sock") if self.checkpoint_dir else None

    def parsed_faults(self) -> dict[str, Any]:
        try:
            return parse_faults(self.faults)
        except ValueError as e:
            raise ConfigError(f"faults: {e}") from None

    def parsed_harness(self) -> Harness:
        try:
            return Harness.parse(self.harness)
        except ValueError as e:
            raise ConfigError(f"harness: {e}") from None

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
    if published.get("data") == LOCAL_DATA:
        if "data" not in explicit or local.data == "builtin":
            raise ConfigError("data: this run trains on data of its own, not the built-in corpus; pass --data PATH "
                              "(each daemon reads its own copy; the run's config does not publish paths)")
        published = {**published, "data": local.data}
    if published.get("model") == OWN_MODEL and "model" in explicit:
        published = {**published, "model": local.model}  # the digest, not the name, says whether it is the same
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
