"""``atoll start``, ``atoll status`` and ``atoll token``.

Bad configuration: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from .config import ConfigError, NodeConfig, RunConfig, load_config

_RUN_ID = NodeConfig().run_id  # default of ``atoll status`` and ``atoll token`` too


class _BoolFlag(argparse.Action):
    """``--flag true|false`` (argparse checks the choice) stored as a bool."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        setattr(namespace, self.dest, values == "true")


def config_fields() -> list[dataclasses.Field]:
    """The fields behind ``atoll start``'s flags and the TOML keys: every ``RunConfig`` and ``NodeConfig`` field
    but ``NodeConfig.run``."""
    return [*dataclasses.fields(RunConfig), *(f for f in dataclasses.fields(NodeConfig) if f.name != "run")]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def show_default(value: Any) -> str:
    """A field default as ``--help`` shows it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return " ".join(value) if value else "none"
    return str(value)


def field_help(f: dataclasses.Field) -> str:
    if f.metadata.get("hidden"):
        return argparse.SUPPRESS
    known = f.metadata.get("known")
    tail = f"one of {', '.join(known)}; " if known else ""
    return f"{f.metadata['help']} ({tail}default: {show_default(f.default)})".replace("%", "%%")


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": field_help(f)}
    default = f.default
    if f.metadata.get("switch"):
        kwargs.update(action="store_const", const=True)
    elif isinstance(default, bool):
        kwargs.update(action=_BoolFlag, choices=("true", "false"))
    else:
        if isinstance(default, tuple) and f.metadata.get("repeat"):
            kwargs.update(action="append")
        elif isinstance(default, tuple):
            kwargs.update(nargs="+")
        elif isinstance(default, (int, float)):
            kwargs.update(type=type(default))
        if "metavar" in f.metadata:
            kwargs.update(metavar=f.metadata["metavar"])
    group.add_argument(flag_of(f), **kwargs)


def _start_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="start a daemon: join a run, or start a new one when no peers are given")
    p.add_argument("--config", metavar="TOML", help="config file (keys: the long flag names with underscores; run "
                                                     "fields flat or under [run]); flags override it")
    run = p.add_argument_group("run", "shared by every daemon of a run: a new run publishes them; a joiner adopts "
                                      "the run's and refuses to start if one it was given disagrees")
    for f in dataclasses.fields(RunConfig):
        _add_field(run, f)
    node = p.add_argument_group("daemon", "local to this daemon")
    for f in dataclasses.fields(NodeConfig):
        if f.name != "run":
            _add_field(node, f)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``atoll start``'s flags as ``load_config`` overrides: every config field, None where the flag is unset."""
    out: dict[str, Any] = {}
    for f in config_fields():
        value = getattr(args, f.name)
        out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def _status_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="read a run's progress from the DHT")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", required=True)
    p.add_argument("--run-id", default=_RUN_ID)
    p.add_argument("--json", action="store_true", help="print stable JSON (run_id, config, peers, totals)")


def _token_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="admit a daemon to a private run: write a join token signed by the run key")
    p.add_argument("--run-key", metavar="FILE", required=True, help="the run key (<checkpoint-dir>/run.key of the "
                                                                    "daemon that started the run)")
    p.add_argument("--run-id", default=_RUN_ID)
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

            cfg, explicit = load_config(config_overrides(args), args.config)
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
