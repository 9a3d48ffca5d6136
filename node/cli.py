"""``atoll start``, ``atoll status``, ``atoll dashboard``, ``atoll pause``, ``atoll resume``, ``atoll token``,
``atoll token revoke`` (also ``atoll revoke``), ``atoll data prepare``, and ``atoll export``, ``atoll sample`` and
``atoll eval`` (``node/home/model_commands.py``).

Bad configuration: one line on stderr, exit code 2, no traceback.

The commands that only read or write a few DHT records (``LIGHT_COMMANDS``: status, dashboard, token, revoke)
import no torch and no model code: their parser is built alone, without ``atoll start``'s config fields, and
hivemind's packages are made lazy first (``protocols/light_import.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from .checks import DEFAULT_RUN_ID, ConfigError
from .home import model_commands  # argparse and checks only: light

_RUN_ID = DEFAULT_RUN_ID  # default of ``atoll status`` and ``atoll token`` too
LIGHT_COMMANDS = ("status", "dashboard", "token", "revoke")


class _BoolFlag(argparse.Action):
    """``--flag true|false`` (argparse checks the choice) stored as a bool."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        setattr(namespace, self.dest, values == "true")


def config_fields() -> list[dataclasses.Field]:
    """The fields behind ``atoll start``'s flags and the TOML keys: every ``RunConfig`` and ``NodeConfig`` field
    but ``NodeConfig.run``."""
    from .config import NodeConfig, RunConfig

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
    from .config import NodeConfig, RunConfig

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
    p.add_argument("--json", action="store_true", help="print stable JSON (run_id, config, peers, totals, summary)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                   help="list every peer (read every progress record), or only the run's totals from its summaries "
                        "(--no-peers, where there are any); by default a run of up to 64 peers is listed")
    p.add_argument("--watch", nargs="?", type=float, const=5.0, default=None, metavar="SECONDS",
                   help="read the run again every SECONDS (default 5) and show it in place, with the run's rates, "
                        "until Ctrl-C; with --json, one JSON document a line")
    _verify_args(p)


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join-token", default=None, metavar="PATH",
                   help="a private run's join token: read only records whose certificates its run key signed")
    p.add_argument("--run-key", default=None, metavar="PATH", help="the run key: the same check, for its holder")


def _dashboard_parser(sub: argparse._SubParsersAction) -> None:
    from .ops.dashboard import HISTORY_POINTS, POLL_EVERY

    p = sub.add_parser("dashboard", help="serve a web page of a run's progress, read from the DHT")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", required=True)
    p.add_argument("--run-id", default=_RUN_ID)
    p.add_argument("--host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1: this "
                                                       "machine only)")
    p.add_argument("--port", type=int, default=8470, help="port to serve the page on (default 8470; 0: a free one)")
    p.add_argument("--interval", type=float, default=POLL_EVERY, metavar="SECONDS",
                   help=f"read the run every SECONDS (default {POLL_EVERY:g})")
    p.add_argument("--history", type=int, default=HISTORY_POINTS, metavar="POINTS",
                   help=f"points kept per curve (and its newest); past it, every second one is dropped and only "
                        f"every second new one kept (default {HISTORY_POINTS})")
    _verify_args(p)


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


def _revoke_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("revoke", help="revoke members of a private run (also: atoll token revoke): publish a list "
                                      "signed by the run key; its daemons then refuse the members' records")
    p.add_argument("--run-key", metavar="FILE", required=True, help="the run key")
    p.add_argument("--run-id", default=_RUN_ID)
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", required=True, help="daemons of the run")
    p.add_argument("--token", action="append", default=[], metavar="FILE", help="a join token to revoke (repeatable)")
    p.add_argument("--peer-id", action="append", default=[], metavar="ID",
                   help="a member's peer id to revoke, as `atoll status` shows it (repeatable)")


def revoke(run_key: str, run_id: str, initial_peers: list[str], tokens: list[str], peer_ids: list[str]) -> int:
    """Add members to the run's revocation list (a higher serial, signed by the run key) and store it in the DHT.
    The list is also kept next to the run key (``<run key>.revoked``), so a later revocation extends it even if
    the run's daemons are gone."""
    import base64
    import json

    from hivemind.utils import get_dht_time

    from atoll.protocols import dht_io
    from atoll.protocols.auth import AuthError, Certificate, RunKey, fingerprint
    from atoll.protocols.identity import is_peer_id, peer_id_of
    from atoll.protocols.revocation import REVOCATION_TTL, RevocationList, newest_revocation
    from atoll.protocols.record_validator import make_validators
    from atoll.protocols.records import revoked_key, unwrap_subkeys

    from .ops.reader import check_target, open_reader

    try:
        key = RunKey.load(run_key)
    except AuthError as e:
        raise ConfigError(f"run_key: {e}") from None
    revoke_ids = []
    for path in tokens:
        try:
            doc = json.loads(open(path).read())
            cert = Certificate.from_bytes(base64.b64decode(doc["certificate"], validate=True))
        except (OSError, ValueError, KeyError, TypeError, AuthError) as e:
            raise ConfigError(f"token: {path!r} is not a readable join token ({e})") from None
        if cert.run_public_key != key.public_bytes or cert.run_id != run_id:
            raise ConfigError(f"token: {path!r} is for run {cert.run_id!r} of run key "
                              f"{fingerprint(cert.run_public_key)}, not run {run_id!r} of this run key")
        peer = peer_id_of(cert.member_key)
        if peer is None:
            raise ConfigError(f"token: {path!r} holds a member key of an older atoll (RSA), which no daemon of this "
                              "version accepts; name its member by --peer-id if it must be revoked")
        revoke_ids.append(peer)
    for peer in peer_ids:
        if not is_peer_id(peer):
            raise ConfigError(f"peer_id: {peer!r} is not a peer id (like 12D3KooWXyz..., 52 characters)")
        revoke_ids.append(peer)
    if not revoke_ids:
        raise ConfigError("revoke: name the members to revoke with --token FILE or --peer-id ID")
    kept_path = run_key + ".revoked"
    kept = None
    if os.path.exists(kept_path):
        import msgpack

        try:
            with open(kept_path, "rb") as f:
                kept = RevocationList.parse(run_id, msgpack.unpackb(f.read(), raw=False))
        except (OSError, ValueError, msgpack.UnpackException):
            kept = None
        if kept is not None and not kept.verify(key.public_bytes):
            kept = None
    import logging

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    check_target(run_id, initial_peers)
    validators = make_validators(run_id, key.issue_token(run_id, expires_at=time.time() + 3600))
    dht = open_reader(run_id, initial_peers, validators)
    try:
        found = list(unwrap_subkeys(dht_io.get_blocking(dht, revoked_key(run_id))).values())
        current, _ = newest_revocation(run_id, key.public_bytes, found, kept)
        revoked = set(current.revoked if current is not None else ()) | set(revoke_ids)
        new = RevocationList(run_id, (current.serial if current is not None else 0) + 1, tuple(sorted(revoked)),
                             float(time.time())).signed(key)
        if not dht_io.store_blocking(dht, revoked_key(run_id), new.to_record(), get_dht_time() + REVOCATION_TTL,
                                     validators[0].local_public_key):
            raise ConfigError(f"initial_peers: could not store the revocation list at {' '.join(initial_peers)}")
    finally:
        dht.shutdown()
    import msgpack

    tmp = kept_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(new.to_record(), use_bin_type=True))
    os.replace(tmp, kept_path)
    print(f"revocation list {new.serial} of run {run_id!r}: {len(new.revoked)} member(s) revoked "
          f"({', '.join(p[-8:] for p in sorted(set(revoke_ids)))} now); its daemons refuse them within seconds")
    return 0


def _data_parser(sub: argparse._SubParsersAction) -> None:
    from atoll.models.prepare import DEFAULT_HELD_OUT, DEFAULT_SHARD_TOKENS, DEFAULT_VOCAB

    p = sub.add_parser("data", help="prepare tokenized datasets (then: atoll start --data DIR)")
    actions = p.add_subparsers(dest="action", required=True)
    prep = actions.add_parser("prepare", help="tokenize text files, folders, JSONL or Parquet into shards with a "
                                              "manifest (docs/data.md)")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, folders (read recursively), .jsonl "
                                                                 "or .parquet files")
    prep.add_argument("--out", metavar="DIR", required=True, help="the dataset folder to write")
    prep.add_argument("--text-field", default="text", metavar="NAME",
                      help="the JSONL field or Parquet column holding the text (default: text)")
    prep.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json to use (default: train a byte-level "
                                                          "BPE on the inputs)")
    prep.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                      help=f"vocabulary of the trained BPE (default: {DEFAULT_VOCAB}; ignored with --tokenizer)")
    prep.add_argument("--held-out", type=float, default=DEFAULT_HELD_OUT, metavar="FRACTION",
                      help=f"fraction of documents in the held-out split (default: {DEFAULT_HELD_OUT})")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                      help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS})")
    prep.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")


def prepare_data(args: argparse.Namespace) -> int:
    from atoll.models.prepare import PrepareError, PrepareOptions, prepare

    options = PrepareOptions(text_field=args.text_field, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                             held_out=args.held_out, shard_tokens=args.shard_tokens, force=args.force)
    try:
        m = prepare(list(args.inputs), args.out, options)
    except PrepareError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unreadable input, a full or read-only disk: still one line
        raise ConfigError(f"{e.filename or args.out}: {e.strerror or e}") from None
    print(f"wrote {m.documents['train']} training and {m.documents['held_out']} held-out documents "
          f"({m.tokens['train']} and {m.tokens['held_out']} tokens, {m.dtype.name}) in {len(m.shards)} shard(s), "
          f"vocab {m.vocab_size} ({'trained' if m.tokenizer_trained else 'given'} tokenizer, sha256 "
          f"{m.tokenizer_sha256[:16]}...) to {args.out}; train on it with atoll start --data {args.out}")
    return 0


def _control_parser(sub: argparse._SubParsersAction) -> None:
    for op, what in (("pause", "pause a daemon on this machine: it frees the accelerator and stays in the run"),
                     ("resume", "resume a paused daemon on this machine: it catches up and trains again")):
        p = sub.add_parser(op, help=what)
        p.add_argument("--checkpoint-dir", metavar="DIR", help="the daemon's --checkpoint-dir (its control.sock)")
        p.add_argument("--control-socket", metavar="PATH", help="the daemon's --control-socket, if it set one")
        p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                       help=f"seconds to wait until the daemon did {op} (default 600; 0: only ask)")


def build_parser(light: bool = False) -> argparse.ArgumentParser:
    """Every command's parser; with ``light``, only ``LIGHT_COMMANDS``' (no config or model imports)."""
    parser = argparse.ArgumentParser(prog="atoll", description="Decentralized pre-training with DiLoCo over a DHT.")
    sub = parser.add_subparsers(dest="command", required=True)
    if not light:
        _start_parser(sub)
    _status_parser(sub)
    _dashboard_parser(sub)
    _token_parser(sub)
    _revoke_parser(sub)
    if not light:
        _data_parser(sub)
        _control_parser(sub)
        model_commands.add_parsers(sub, _RUN_ID)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["token", "revoke"]:
        argv = argv[1:]  # ``atoll token revoke ...`` is ``atoll revoke ...``
    light = bool(argv) and argv[0] in LIGHT_COMMANDS
    if light:
        from atoll.protocols import light_import

        light_import.install()
    args = build_parser(light).parse_args(argv)
    try:
        if args.command == "start":
            from .config import load_config
            from .island.daemon import run_daemon
            from .log import setup_logging

            from .island.launch import launch, wants_launcher

            cfg, explicit = load_config(config_overrides(args), args.config)
            setup_logging(cfg.log_level, cfg.log_format)
            if wants_launcher(cfg):
                return launch(cfg, argv[1:])
            return run_daemon(cfg, explicit)
        if args.command == "token":
            return issue_token(args.run_key, args.run_id, args.out, args.expires_in)
        if args.command == "revoke":
            return revoke(args.run_key, args.run_id, list(args.initial_peers), args.token, args.peer_id)
        if args.command == "data":
            return prepare_data(args)
        if args.command in model_commands.COMMANDS:
            return model_commands.run(args)
        if args.command in ("pause", "resume"):
            from .island.control import run_control, socket_path

            return run_control(args.command, socket_path(args.control_socket, args.checkpoint_dir), args.wait)
        if args.command == "dashboard":
            from .ops.dashboard import run_dashboard

            return run_dashboard(list(args.initial_peers), args.run_id, args.host, args.port, args.interval,
                                 args.history, args.join_token, args.run_key)
        from .ops.status import run_status

        return run_status(list(args.initial_peers), args.run_id, args.json, args.peers, args.watch, args.join_token,
                          args.run_key)
    except ConfigError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
