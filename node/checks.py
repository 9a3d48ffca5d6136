"""What every command checks before it starts, without the training config's imports (torch, the models):
``ConfigError`` and the run id and multiaddr checks, shared by ``NodeConfig`` and the DHT readers (``atoll status``,
``atoll dashboard``, ``atoll revoke``), which import nothing else of the node."""

from __future__ import annotations

from multiaddr import Multiaddr

DEFAULT_RUN_ID = "atoll"


class ConfigError(ValueError):
    """Bad configuration; the CLI prints it as one line and exits with code 2."""


def check_run_id(run_id: str) -> None:
    if not run_id.replace("-", "").replace("_", "").isalnum() or len(run_id) > 64:
        raise ConfigError(f"run_id: {run_id!r} must be 1-64 letters, digits, '-' or '_'")


def check_maddr(name: str, addr: str, need_peer_id: bool) -> None:
    try:
        maddr = Multiaddr(addr)
    except Exception as e:  # the multiaddr package raises several exception types
        raise ConfigError(f"{name}: malformed multiaddr {addr!r} ({e})") from None
    if need_peer_id and "/p2p/" not in str(maddr):
        raise ConfigError(f"{name}: {addr!r} lacks the /p2p/<peer id> part (copy a line that `atoll start` printed)")
