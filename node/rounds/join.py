"""Getting into a run: this daemon's membership, the DHT, and agreement on the run's configuration.

A private run admits daemons that hold a join token (or its run key); an open run admits anyone. The daemon that
starts a run publishes its ``RunConfig``; joiners adopt it and refuse to start, with one line, if a field they set
explicitly disagrees or their credentials do not match the run's access.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from atoll.protocols import dht_guard, dht_io
from atoll.protocols.dht_setup import DHT_NODE_OPTIONS, apply_p2pd_environment, start_with_retries
from atoll.protocols.local_dht import LocalDHT
from atoll.protocols.auth import AuthError, JoinToken, RunKey, fingerprint, signed_by
from atoll.protocols.identity import IdentityError, MemberKey
from atoll.protocols.revocation import RevocationList
import msgpack
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import RunConfigRecord, config_key, config_payload, parse_run_config, unwrap_subkeys

from ..config import ConfigError, NodeConfig, RunConfig, reconcile_run_config

logger = logging.getLogger("atoll")
CONFIG_TTL = 24 * 3600.0
NEW_RUN_LOOK = 5.0  # seconds a --new-run daemon looks for the run at its peers before it starts the run
def start_dht(cfg: NodeConfig, validators: list, client_mode: bool = False, identity_path: str | None = None,
              ) -> DHT | LocalDHT:
    """Start hivemind's DHT (its node in a forked process; with ``cfg.dht_in_process`` on a thread of this one,
    ``protocols/local_dht.py``), retrying bootstrap; ``ConfigError`` if no initial peer answers. ``identity_path``:
    the libp2p identity (default: ``cfg.identity_path``; see ``identity_file`` for a private run's). ``client_mode``:
    a reader that lives for one command or test: a client DHT node with a throwaway identity. A daemon with
    ``cfg.client_mode`` (behind NAT) runs a client DHT node too, but keeps its identity (its peer id is its member
    key's in a private run, and it picks its data shard)."""
    apply_p2pd_environment()
    dht_guard.install()  # before the DHT's process forks from ours (or its node starts here): the bounded handlers
    options = dict(
        # A client node serves no DHT requests and stays out of the others' routing tables: nobody wastes a dial
        # (a timeout, on the internet) on an address behind NAT.
        initial_peers=list(cfg.initial_peers), client_mode=client_mode or cfg.client_mode,
        host_maddrs=list(cfg.host_maddrs), announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=None if client_mode else (identity_path or cfg.identity_path),
        startup_timeout=30, **DHT_NODE_OPTIONS,
    )

    def start() -> DHT | LocalDHT:
        if cfg.dht_in_process:
            return LocalDHT.create(validators=validators, **options)
        return DHT(start=True, record_validators=validators, **options)

    try:
        return start_with_retries(start, cfg.bootstrap_retries)
    except Exception as e:
        if cfg.initial_peers:
            raise ConfigError(f"initial_peers: could not reach any bootstrap peer after {cfg.bootstrap_retries} "
                              f"attempts ({e})") from None
        raise RuntimeError(f"could not start the DHT: {e}") from e


def membership(cfg: NodeConfig) -> JoinToken | None:
    """This daemon's membership of a private run (None: an open run). A join token, or a certificate issued to
    ourselves by the run key we hold; a new run without ``open`` creates its run key."""
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
    identity = _load_or_create_identity(cfg.identity_path)
    return JoinToken(identity, key.certify(cfg.run_id, identity.owner))


def _load_or_create_identity(path: str | None) -> MemberKey:
    """The member key of the libp2p identity file at ``path``, created there if missing (a new key if ``path`` is
    None): the run key's holder certifies it, so its peer id stays the one its identity file gives it."""
    if path is None:
        return MemberKey.generate()
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                return MemberKey.from_identity(f.read())
        except (OSError, IdentityError) as e:
            raise ConfigError(f"identity: {path!r}: {e}") from None
    key = MemberKey.generate()
    _write_identity(path, key)
    return key


def _write_identity(path: str, key: MemberKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(key.identity_bytes())


def identity_file(cfg: NodeConfig, token: JoinToken | None) -> tuple[str | None, bool]:
    """The libp2p identity file the DHT starts with, and whether it is a temporary copy to delete once it started.

    An open run: ``cfg.identity_path`` (as given, or ``<checkpoint-dir>/identity.key``; created by hivemind).
    A private run: the member key, so that the peer id is the hash of the key that signs the member's records
    (``identity.peer_id_of``), which every reader checks. An identity file that exists must hold that key: one given
    with ``--identity`` that holds another is refused (one line); the default one, left by an older daemon, is
    ignored (the member key is written to a temporary file instead). A missing one is created with the member key.
    """
    path = cfg.identity_path
    if token is None:
        return path, False
    member = token.member_key.owner
    if path is not None and os.path.exists(path):
        try:
            with open(path, "rb") as f:
                held = MemberKey.from_identity(f.read()).owner
        except (OSError, IdentityError) as e:
            held, problem = None, str(e)
        else:
            problem = "it holds another key than the join token's member key"
        if held == member:
            return path, False
        if cfg.identity is not None:
            raise ConfigError(f"identity: {path!r}: {problem}; in a private run the peer id is the member key's: "
                              "drop --identity or name a file that does not exist yet")
        logger.info("not using %s: a private run's peer id is its member key's", path)
    elif path is not None:
        _write_identity(path, token.member_key)
        return path, False
    fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=cfg.checkpoint_dir)
    with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600
        f.write(token.member_key.identity_bytes())
    return tmp, True


def start_member_dht(cfg: NodeConfig, namespaces: Sequence[str] = ()) -> tuple[DHT, JoinToken | None,
                                                                               RevocationList | None, list]:
    """The DHT node of a member of ``cfg``'s run, started with its credentials: (dht, join token or None for an open
    run, the revocation list it knows, its record validators, the first of which signs its records). The caller
    shuts the DHT down. ``ConfigError`` for credentials or peers the user must fix. ``namespaces``: more names its
    node accepts the run's static records under (``make_validators``)."""
    token = membership(cfg)
    revocation = load_revocation(cfg, token)
    validators = make_validators(cfg.run_id, token, revocation, namespaces)
    identity, temporary = identity_file(cfg, token)
    try:
        dht = start_dht(cfg, validators, identity_path=identity)
    finally:
        if temporary:
            os.unlink(identity)
    try:
        check_identity(dht, token)
    except BaseException:
        dht.shutdown()
        raise
    return dht, token, revocation, validators


def check_identity(dht: DHT, token: JoinToken | None) -> None:
    """A private run's peer id must be the member key's (every reader refuses records claiming another)."""
    expected = token.member_key.peer_id if token is not None else None
    if expected is not None and str(dht.peer_id) != expected:
        raise RuntimeError(f"the DHT's peer id {dht.peer_id} is not the member key's {expected}")


REVOCATION_FILE = "revoked.list"


def load_revocation(cfg: NodeConfig, token: JoinToken | None) -> RevocationList | None:
    """The revocation list this daemon kept (``<checkpoint-dir>/revoked.list``), if signed by its run key."""
    if token is None or cfg.checkpoint_dir is None:
        return None
    path = os.path.join(cfg.checkpoint_dir, REVOCATION_FILE)
    try:
        with open(path, "rb") as f:
            rec = RevocationList.parse(cfg.run_id, msgpack.unpackb(f.read(), raw=False))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, msgpack.UnpackException) as e:
        logger.warning("ignoring %s: unreadable (%s)", path, e)
        return None
    if rec is None or not rec.verify(token.run_public_key):
        logger.warning("ignoring %s: not a revocation list signed by the run key", path)
        return None
    return rec


def save_revocation(checkpoint_dir: str | None, revocation: RevocationList) -> None:
    if checkpoint_dir is None:
        return
    path = os.path.join(checkpoint_dir, REVOCATION_FILE)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(revocation.to_record(), use_bin_type=True))
    os.replace(tmp, path)


def check_access(run_id: str, token: JoinToken | None, published: RunConfigRecord) -> None:
    """Refuse, with one clear line, to take part in a run whose access our credentials do not match."""
    if published.access == "private" and token is None:
        raise ConfigError(f"join_token: run {run_id!r} is private (run key {published.run_key}); start with "
                          f"--join-token FILE, issued by a holder of the run key with `atoll token`")
    if published.access == "private" and fingerprint(token.run_public_key) != published.run_key:
        raise ConfigError(f"join_token: the token is for run key {fingerprint(token.run_public_key)}, "
                          f"run {run_id!r} uses {published.run_key}")
    if published.access == "open" and token is not None:
        raise ConfigError(f"join_token: run {run_id!r} is open; start without --join-token or --run-key")


def choose_config(run_id: str, token: JoinToken | None, values: Iterable[Any]) -> RunConfigRecord | None:
    """The run's config among the records found under its key (one per publishing key), or None. A member of a
    private run (``token``) takes only a record signed by the run key of its token; others are ignored, and logged:
    a member could publish one claiming an earlier start, access "open", another model. An open run has no key to
    sign with: every live daemon of the run re-publishes the record it adopted, so the record that the most keys
    publish is the run's (one later claim of an earlier start does not replace it), the earliest among equals."""
    records, forged = [], 0
    for value in values:
        rec = parse_run_config(value)
        if rec is None:
            forged += 1
        elif token is not None and not (rec.access == "private" and signed_by(
                token.run_public_key, config_payload(run_id, rec), rec.signature)):
            forged += 1
        else:
            records.append(rec)
    if forged:
        logger.warning("ignored %d run config record(s) of run %r that are malformed or not signed by its run key",
                       forged, run_id)
    if not records:
        return None
    holders = Counter(_content(r) for r in records)
    return min(records, key=lambda r: (-holders[_content(r)], r.started_at, _content(r)))


def _content(rec: RunConfigRecord) -> str:
    return json.dumps(rec.dict(exclude={"signature"}), sort_keys=True, default=repr) + repr(rec.signature)


def read_run_config(dht: DHT, cfg: NodeConfig, token: JoinToken | None) -> RunConfigRecord | None:
    """The run's published config record, read from the peers ``cfg.initial_peers`` reached; None only with
    ``cfg.new_run`` (none found in a short look: the caller starts the run). ``ConfigError`` when there is none
    after ``cfg.config_wait`` seconds, or when this member may not join it.

    A daemon pointed at peers joins their run; on a loaded machine or a slow link the config can take a while to
    read. Starting a run of its own there instead would fork the run (a restarted daemon did, training alone on its
    checkpoint), so it waits, then gives up; with ``new_run`` it starts the run once a short look found none
    (several daemons started together at a bootstrap node may each do so: the earliest record is the run's for
    everyone who joins later)."""
    key = config_key(cfg.run_id)
    deadline = time.monotonic() + (NEW_RUN_LOOK if cfg.new_run else cfg.config_wait)
    while True:
        published = choose_config(cfg.run_id, token, unwrap_subkeys(dht_io.get_blocking(dht, key)).values())
        if published is not None:
            check_access(cfg.run_id, token, published)
            return published
        if cfg.new_run and time.monotonic() > deadline:
            return None
        if time.monotonic() > deadline:
            raise ConfigError(f"initial_peers: no run {cfg.run_id!r} found there in {cfg.config_wait:.0f} s; "
                              "check --run-id, or pass --new-run to start a new run there")
        time.sleep(1)


def agree_on_run_config(dht: DHT, cfg: NodeConfig, explicit: set[str], token: JoinToken | None, subkey: bytes,
                        derive: Callable[[RunConfig], dict[str, Any]] | None = None
                        ) -> tuple[NodeConfig, dict[str, Any]]:
    """Adopt the run's published config (joiners) or publish ours (the daemon that starts the run). Returns the
    config to run with and the run's config record (which the syncer keeps re-publishing). ``derive``: the fields
    the daemon that starts the run derives from its config and publishes, so that every joiner can check its own
    against them (``model_digest``: ``models/registry.py``; ``tokenizer``: ``models/data.py``)."""
    key = config_key(cfg.run_id)
    published = read_run_config(dht, cfg, token) if cfg.initial_peers else None
    if published is not None:
        cfg = dataclasses.replace(cfg, run=reconcile_run_config(cfg.run, explicit, published.fields))
        record = published.dict()
        logger.info("joined run %r started by %s", cfg.run_id, published.started_by[-8:])
    else:
        private = token is not None
        if derive is not None:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **derive(cfg.run)))
        published = RunConfigRecord(
            fields=cfg.run.published(), started_by=str(dht.peer_id), started_at=float(get_dht_time()),
            access="private" if private else "open", run_key=fingerprint(token.run_public_key) if private else None,
        )
        if private:
            try:
                run_key = RunKey.load(cfg.run_key_path)
            except AuthError as e:
                raise ConfigError(f"run_key: only a holder of the run key starts a private run ({e})") from None
            published.signature = run_key.sign(config_payload(cfg.run_id, published))
        record = published.dict()
        logger.info("starting a new %s run %r", "private" if private else "open", cfg.run_id)
    dht_io.store_blocking(dht, key, record, get_dht_time() + CONFIG_TTL, subkey)
    return cfg, record
