"""The DHT client of the commands that only read or write a few records (``atoll status``, ``atoll dashboard``,
``atoll revoke``): hivemind's ``DHTNode`` in this process (``protocols/local_dht.py``), a client node with a
throwaway identity that serves nothing and that no routing table keeps. A daemon's forked DHT process and its
shared-memory futures would cost a command more than its read; with ``protocols/light_import.py`` installed first,
nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from atoll.protocols.dht_setup import DHT_NODE_OPTIONS, apply_p2pd_environment, start_with_retries
from atoll.protocols.local_dht import LocalDHT

from ..checks import ConfigError, check_maddr, check_run_id

STARTUP_TIMEOUT = 30.0  # seconds for p2pd to start and one initial peer to answer, as a daemon's DHT start
BOOTSTRAP_RETRIES = 3  # NodeConfig's default


def check_target(run_id: str, initial_peers: Sequence[str]) -> None:
    """``ConfigError`` (one line) for a bad run id or initial peer address."""
    check_run_id(run_id)
    if not initial_peers:
        raise ConfigError("initial_peers: give the multiaddr of a daemon of the run (one that `atoll start` printed)")
    for addr in initial_peers:
        check_maddr("initial_peers", addr, need_peer_id=True)


def open_reader(run_id: str, initial_peers: Sequence[str], validators: list,
                retries: int = BOOTSTRAP_RETRIES) -> LocalDHT:
    """A started client ``LocalDHT`` of run ``run_id`` through ``initial_peers``; ``ConfigError`` (one line) for a bad
    run id or address (``check_target``), or when no initial peer answers after ``retries`` tries (2 s, then 4 s, ...
    apart, as a daemon's)."""
    check_target(run_id, initial_peers)
    apply_p2pd_environment()
    try:
        return start_with_retries(lambda: LocalDHT.create(
            initial_peers, validators, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            startup_timeout=STARTUP_TIMEOUT, **DHT_NODE_OPTIONS), retries)
    except Exception as e:
        raise ConfigError(f"initial_peers: could not reach any bootstrap peer after {retries} attempts ({e})") from None
