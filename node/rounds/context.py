"""What the syncer's parts share: who this daemon is, its replica, counters and traffic, and the event loop's
bookkeeping. Built once by ``Syncer``; the peer table, catch-up and the round protocol each hold it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from hivemind import DHT

from atoll.models.outer import NesterovOuter
from atoll.protocols.error_feedback import ErrorFeedback
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
    subkey: bytes  # our owner marker (member key): the DHT lets only us write records under it
    replica: Replica
    counters: Counters
    faults: Faults
    stats: TrafficStats
    cooldown: Cooldown
    outer: NesterovOuter
    error_feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # touched on the event loop only
    in_round: set[int] = field(default_factory=set)  # fragments with a round of ours under way
    leaving: bool = False
    settle_until: float = 0.0  # monotonic: until then a lone merge reads the table afresh (after a stall)
    loop_due: float = 0.0  # monotonic: when the stall watch is next due to run (0: not started)
    gap_ended: float = float("-inf")  # monotonic: when the event loop last ran again after a gap of ANSWER_GRACE
    p2p: Any = None  # hivemind's P2P, once the event loop has started
    spawn: Callable[[Coroutine], Any] = lambda coro: None  # start a background task on the event loop

    @property
    def max_weight(self) -> float:
        """The most weight one member may declare in a round (``Algorithm.weight_bound``; 0: unbounded)."""
        run = self.cfg.run
        return self.algorithm.weight_bound(run.max_step_tokens, run.sync_every, run.overlap)

    def namespace(self) -> str:
        """Where progress records, round registrations and open rounds live (a fault may split the swarm)."""
        return self.faults.namespace(self.cfg.run_id, self.counters.step)

    def reject(self, kind: str, source: str | bytes | None = None) -> None:
        self.stats.reject(kind, source)

    def offence(self, source: str | bytes, kind: str) -> None:
        """A rejected message whose sender is known (a peer id or a record's signing key): cool it down."""
        if source != self.peer_id and source != self.subkey:
            self.cooldown.offend(source, kind)
