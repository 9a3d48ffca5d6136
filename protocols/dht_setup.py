"""How every atoll process starts its hivemind DHT node, daemon or reader: the node's options and p2pd's
environment (imports nothing: ``node/ops/reader.py``'s light readers use it too)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("atoll")
T = TypeVar("T")

# hivemind's DHTNode keeps values it read fresh in the background (a read ``cache_refresh_before_expiry`` s before
# they expire) and stores what it found on the nearest node that lacked it (``cache_nearest``). Every read atoll
# makes asks for the latest value, which no cache answers: both are traffic atoll never uses, and on a thin link
# the DHT's traffic is what delays rounds (docs/results.md, "The thinnest link").
DHT_NODE_OPTIONS = {"cache_refresh_before_expiry": 0, "cache_nearest": 0}


# go-libp2p dials TCP from its own listening port (SO_REUSEPORT) unless this says otherwise. Two daemons that dial
# each other at the same moment (every member of a round opens streams to every reducer at once) then meet in one
# TCP connection by simultaneous open, where both sides run the security handshake as its initiator: both dials
# fail, and libp2p backs off from that peer for seconds, long enough to fail the round. On loopback the two SYNs
# almost never cross; over a WAN's round trip they do in most rounds (docs/wan.md). From ephemeral source ports
# the two dials are two plain connections. Hole punching, which needs the listening port, does not work here
# anyway (docs/wan.md, Behind NAT). p2pd, a child of hivemind's DHT process, reads it from the environment; an
# operator's own setting wins.
P2PD_ENVIRONMENT = {"LIBP2P_TCP_REUSEPORT": "false"}


def apply_p2pd_environment() -> None:
    """Set ``P2PD_ENVIRONMENT`` for the p2pd started after this, where the environment does not set it already."""
    for name, value in P2PD_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def start_with_retries(start: Callable[[], T], tries: int) -> T:
    """``start()`` until it returns, at most ``tries`` times, 2 s, then 4 s, ... apart (a bootstrap peer may be
    starting too); raises the last try's error. hivemind raises plain Exceptions for bootstrap failures."""
    for attempt in range(tries):
        try:
            return start()
        except Exception as e:
            if attempt + 1 >= tries:
                raise
            logger.warning("DHT start failed (%s); retrying in %d s", e, 2 * (attempt + 1))
            time.sleep(2 * (attempt + 1))
    raise ValueError(f"tries must be positive, got {tries}")
