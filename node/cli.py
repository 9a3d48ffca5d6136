"""``atoll start``, ``atoll status`` and ``atoll token``.

Bad configuration: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import DEVICES, ConfigError, load_config


def _start_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="start a daemon: join a run, or start a new one when no peers are given")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of daemons already in the run")
    p.add_argument("--config", metavar="TOML", help="config file (keys: the long flag names with underscores)")
    p.add_argument("--run-id", help="name of the run (default: atoll)")
    p.add_argument("--device", help=f"one of {', '.join(DEVICES)} (default: auto)")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="listen on (default: /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses to tell other peers")
    p.add_argument("--identity", metavar="PATH", help="private key file; keeps the peer id stable across restarts")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints and metrics.jsonl are written")
    p.add_argument("--data", help="'builtin', a text file or folder, or uint16 .bin shards")
    p.add_argument("--model", help="named model shape (tiny, small, ...)")
    p.add_argument("--algorithm", help="decoupled (default), streaming, diloco, or ddp (gradient all-reduce per step)")
    p.add_argument("--compression", help="codec of outer deltas: none, bf16, int8, int4 (default), fp4, int2")
    p.add_argument("--error-feedback", choices=("true", "false"), help="keep what quantization dropped (default true)")
    p.add_argument("--fragments", type=int, metavar="P", help="fragments (streaming, decoupled)")
    p.add_argument("--overlap", type=int, metavar="TAU", help="inner steps between a fragment's snapshot and merge")
    p.add_argument("--quorum", type=int, metavar="K",
                   help="minimum round size (decoupled); ddp: daemons that start together")
    p.add_argument("--max-group", type=int, metavar="N", help="round-size cap; more ready daemons form several groups")
    p.add_argument("--grace-gamma", type=float, metavar="G", help="share of the overlap's slack a round may wait (0.5)")
    p.add_argument("--join-window", choices=("true", "false"),
                   help="a round waits at least as long as a peer needs to join it (decoupled; default true)")
    p.add_argument("--rda", choices=("true", "false"), help="radial-directional averaging (decoupled; default true)")
    p.add_argument("--stale-contributions", choices=("true", "false"),
                   help="keep work a round missed for the next one (decoupled; default false)")
    p.add_argument("--sync-every", type=int, metavar="H", help="inner steps between outer rounds")
    p.add_argument("--inner-lr", type=float, metavar="LR", help="AdamW learning rate of the inner steps (default 1e-3)")
    p.add_argument("--outer-lr", type=float, metavar="LR", help="outer step size (default 0.7)")
    p.add_argument("--outer-momentum", type=float, metavar="MU", help="outer Nesterov momentum (default 0.9; 0: plain "
                                                                       "averaging when --outer-lr is 1)")
    p.add_argument("--seed", type=int, help="seed of the initial model and of the data order (default: 0)")
    p.add_argument("--batch-size", type=int, help="sequences per inner step on this daemon")
    p.add_argument("--max-steps", type=int, help="stop after this many inner steps (default: run until stopped)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1)")
    p.add_argument("--heartbeat", type=float, help="seconds between progress records (default: 2)")
    p.add_argument("--gather-timeout", type=float, help="seconds a round waits for expected members")
    p.add_argument("--round-timeout", type=float, help="seconds a reducer waits for missing parts")
    p.add_argument("--clip-factor", type=float, metavar="F",
                   help="scale contributions above F x the round's median norm to the median (0: off; default 4)")
    p.add_argument("--peer-cooldown", type=float, metavar="S",
                   help="seconds a peer whose message was rejected is left out of rounds (default 120)")
    p.add_argument("--eval-budget", type=float, metavar="SHARE",
                   help="share of wall time the held-out evaluation may take (default 0.01; 1: after every merge)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--join-token", metavar="FILE", help="membership of a private run (issued with `atoll token`)")
    p.add_argument("--run-key", metavar="FILE",
                   help="run key of a private run (created when starting a new run; default <checkpoint-dir>/run.key)")
    p.add_argument("--open", action="store_const", const=True,
                   help="start an open run that any daemon may join (default: a new run is private)")
    p.add_argument("--fault", dest="faults", action="append", metavar="NAME=VALUE", help=argparse.SUPPRESS)


def _status_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="read a run's progress from the DHT")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", required=True)
    p.add_argument("--run-id", default="atoll")
    p.add_argument("--json", action="store_true", help="print stable JSON (run_id, config, peers, totals)")


def _token_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="admit a daemon to a private run: write a join token signed by the run key")
    p.add_argument("--run-key", metavar="FILE", required=True, help="the run key (<checkpoint-dir>/run.key of the "
                                                                    "daemon that started the run)")
    p.add_argument("--run-id", default="atoll")
    p.add_argument("--out", metavar="FILE", required=True, help="where to write the token (readable by you only)")
    p.add_argument("--expires-in", type=float, metavar="HOURS", help="valid for this long (default: no expiry)")


def issue_token(run_key: str, run_id: str, out: str, expires_in: float | None) -> int:
    from atoll.protocols.auth import AuthError, RunKey, fingerprint

    if expires_in is not None and not expires_in > 0:
        raise ConfigError(f"expires_in: must be a positive number of hours, got {expires_in}")
    if os.path.exists(out):
        raise ConfigError(f"out: {out!r} exists; a join token is never overwritten")
    try:
        key = RunKey.load(run_key)
    except AuthError as e:
        raise ConfigError(f"run_key: {e}") from None
    expires_at = time.time() + 3600 * expires_in if expires_in is not None else 0.0
    key.issue_token(run_id, expires_at).save(out)
    print(f"wrote a join token for run {run_id!r} (run key {fingerprint(key.public_bytes)}) to {out}; "
          f"start the daemon with --join-token {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atoll", description="Decentralized pre-training with DiLoCo over a DHT.")
    sub = parser.add_subparsers(dest="command", required=True)
    _start_parser(sub)
    _status_parser(sub)
    _token_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "start":
            from .daemon import run_daemon
            from .log import setup_logging

            overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
            cfg, explicit = load_config(overrides, args.config)
            setup_logging(cfg.log_level)
            return run_daemon(cfg, explicit)
        if args.command == "token":
            return issue_token(args.run_key, args.run_id, args.out, args.expires_in)
        from .status import run_status

        return run_status(list(args.initial_peers), args.run_id, args.json)
    except ConfigError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
