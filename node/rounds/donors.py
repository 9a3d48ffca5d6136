"""Whom a fragment's replica is downloaded from: the donors among the live peers (``donors``), those whose claim
enough of them vouch for (``vouched``), and the order to ask them in (``donor_order``). Read by catch-up, joining
and restoring; pure functions of the peers' progress records."""

from __future__ import annotations

from collections import Counter

from atoll.protocols.records import ProgressRecord, Status


def donors(peers: dict[str, ProgressRecord]) -> list[ProgressRecord]:
    """Whom a joiner (or a daemon back from a checkpoint or a pause) downloads the run's state from: the training
    peers; when none trains, the paused ones, which still hold it and serve it. Never both: a paused peer's replica
    is as old as its pause, and counting it among the vouchers would leave a training peer's newer replica
    unvouched."""
    training = [peer for peer in peers.values() if peer.status == Status.TRAINING]
    return training or [peer for peer in peers.values() if peer.status == Status.PAUSED]


def vouched(p: int, peers: list[ProgressRecord], vouchers: int) -> list[ProgressRecord]:
    """The ``peers`` whose replica of fragment ``p`` is vouched for: held, with the same (version, weight, digest),
    by at least ``min(vouchers, len(peers))`` of them (``peers``: distinct live peers, ourselves left out)."""
    held = Counter(peer.fragment(p) for peer in peers)
    needed = min(vouchers, len(peers))
    return [peer for peer in peers if held[peer.fragment(p)] >= needed]


def donor_order(p: int, peers: list[ProgressRecord]) -> list[ProgressRecord]:
    """Whom to download fragment ``p`` from, best first: the peers holding its heaviest replica, rotated by ``p``
    so that concurrent downloads of different fragments start at different donors (and a donor that fails
    mid-transfer is followed by another holding the same replica, which can resume it), then the others,
    heaviest first. Peers behind NAT (``reachable`` False) are never donors: nobody can open a stream to them,
    and a download that cannot succeed must not count against them as a claim they did not back."""
    peers = [peer for peer in peers if peer.reachable]
    if not peers:
        return []
    best = max(peer.fragment(p) for peer in peers)
    holders = sorted((peer for peer in peers if peer.fragment(p) == best), key=lambda peer: peer.peer_id)
    k = p % len(holders)
    rest = sorted((peer for peer in peers if peer.fragment(p) != best), key=lambda peer: peer.fragment(p),
                  reverse=True)
    return holders[k:] + holders[:k] + rest
