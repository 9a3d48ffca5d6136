"""How long a round waits, and for whom: the grace window after quorum and the join window for a peer that joins
an opened round (both sized from moving averages of the round's timings, ``EMA``), and the live peers a round of
one fragment waits for (``FragmentPeers``, the view ``matchmaking.form_group`` reads). Pure functions and views:
the round protocol (``round_protocol.py``) decides with them."""

from __future__ import annotations

from collections.abc import Callable

from atoll.protocols.matchmaking import PeerView
from atoll.protocols.records import Status

from .peers import PeerTable

PEERS_MAX_AGE = 1.0  # seconds a peer table read may be reused while forming a group (it is polled)


def grace_window(gamma: float, overlap_steps: int, step_time: float, quorum_time: float, sync_time: float) -> float:
    """How long a round may wait for more members after quorum without costing compute:
    γ·(τ·step_time − quorum_time − sync_time), never negative (the merge is due τ steps after the snapshot)."""
    if not 0 <= gamma < 1:
        raise ValueError(f"gamma must be in [0, 1), got {gamma}")
    return max(0.0, gamma * (overlap_steps * step_time - quorum_time - sync_time))


def join_window(step_time: float, read_time: float, sync_every: int, open_poll: float, group_poll: float) -> float:
    """How long a live peer at the same version needs to join a round that another daemon opened: it reads the open
    rounds every ``open_poll`` s, contributes at its next step boundary (≤ one step, and one more for the snapshot),
    registers (a DHT store), and the coordinator sees it on its next read, every ``group_poll`` s; ``read_time`` is
    one DHT read or store. Capped at H/4 steps: waiting costs every member the steps it trains on the fragment
    before the merge lands (α = 0 overwrites them), a quarter of what a peer left out of the round loses (its H
    steps on the fragment since its last round)."""
    return min(open_poll + group_poll + 2 * step_time + 3 * read_time, sync_every * step_time / 4)


class EMA:
    """Exponential moving average of a duration; 0 until the first sample."""

    def __init__(self, beta: float = 0.7) -> None:
        self.beta, self.value, self._seen = beta, 0.0, False

    def update(self, x: float) -> None:
        self.value = x if not self._seen else self.beta * self.value + (1 - self.beta) * x
        self._seen = True


class FragmentPeers(PeerView):
    """The peer table as a round of fragment ``p`` against the replica ``base`` = (version, digest) sees it: the
    live training peers at their version of p; a peer at our version with another replica is not waited for (it
    meets in another round)."""

    def __init__(self, table: PeerTable, p: int, base: tuple[int, str], revoked: Callable[[str], bool]) -> None:
        self.table, self.p, self.base, self.revoked = table, p, base, revoked
        self.forked: set[str] = set()

    async def live(self) -> dict[str, int]:
        peers, p, (version, digest) = await self.table.refresh(max_age=PEERS_MAX_AGE), self.p, self.base
        self.forked = {peer.peer_id for peer in peers.values()
                       if peer.fragment_versions[p] == version and peer.fragment_hashes[p] != digest}
        return {peer.peer_id: peer.fragment_versions[p] for peer in peers.values() if peer.status == Status.TRAINING}

    async def look_up(self, peer_ids: set[str]) -> bool:
        await self.table.look_up(peer_ids)
        return True

    def expects(self, peer_id: str) -> bool:
        return peer_id not in self.forked

    def shunned(self, peer_id: str) -> bool:
        return self.revoked(peer_id)
