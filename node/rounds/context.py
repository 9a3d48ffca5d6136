"""What the syncer's parts share: who this daemon is, its replica, counters and traffic, and the event loop's
bookkeeping. Built once by ``Syncer``; the peer table, catch-up and the round protocol each hold it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from atoll.models.fragments import Fragment
from atoll.models.outer import NesterovOuter
from atoll.protocols.codecs import ErrorFeedback
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.stats import TrafficStats

from ..algorithm import Algorithm
from ..config import NodeConfig
from ..faults import Faults
from ..metrics import Counters
from .replica import Replica


@dataclass
class SyncContext:
    cfg: NodeConfig
    algorithm: Algorithm
    dht: DHT
    peer_id: str
    subkey: bytes  # our RSA public key: the DHT lets only us write records under it
    replica: Replica
    fragments: list[Fragment]
    counters: Counters
    faults: Faults
    private: bool  # members only: the DHT holds members' records only; state is served to members only
    stats: TrafficStats
    cooldown: Cooldown
    outer: NesterovOuter
    error_feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # touched on the event loop only
    in_round: set[int] = field(default_factory=set)  # fragments with a round of ours under way
    leaving: bool = False
    settle_until: float = 0.0  # monotonic: until then a lone merge reads the table afresh (after a stall)
    realign: bool = False  # after a stall: the next replica adopted before settle_until brings its donor's schedule
    loop_due: float = 0.0  # monotonic: when the stall watch is next due to run (0: not started)
    gap_ended: float = float("-inf")  # monotonic: when the event loop last ran again after a gap of ANSWER_GRACE
    started_at: float = field(default_factory=get_dht_time)  # DHT time this process's syncer was made
    p2p: Any = None  # hivemind's P2P, once the event loop has started
    run_public_key: bytes | None = None  # a private run's run key (signs its revocation lists)
    revocation: Any = None  # the newest revocation list signed by the run key (auth.RevocationList), if any
    spawn: Callable[[Coroutine], Any] = lambda coro: None  # start a background task on the event loop

    def namespace(self) -> str:
        """Where progress records, round registrations and open rounds live (a fault may split the swarm)."""
        return self.faults.namespace(self.cfg.run_id, self.counters.step)

    def revoked(self, peer_id: str) -> bool:
        """Whether the run key revoked ``peer_id``'s membership (its records and requests are refused)."""
        return self.revocation is not None and peer_id in self.revocation.revoked

    def reject(self, kind: str, source: str | bytes | None = None) -> None:
        self.stats.reject(kind, source)

    def offence(self, source: str | bytes, kind: str) -> None:
        """A rejected message whose sender is known (a peer id or a record's signing key): cool it down."""
        if source != self.peer_id and source != self.subkey:
            self.cooldown.offend(source, kind)
