"""Progress records that pass the run's schema, for tests that feed them to validators, tables and readers."""

from __future__ import annotations

from hivemind.utils import get_dht_time

from atoll.protocols.records import ProgressRecord


def progress(peer_id: str = "QmPeer", fragments: int = 1, **changes) -> dict:
    """A progress record's fields, every one valid, for a daemon that has done nothing yet: ``fragments`` replicas
    at version 0 of weight 1; ``changes`` replace any field."""
    rec = {"peer_id": peer_id, "status": "training", "device": "cpu", "ranks": 1, "algorithm": "diloco", "step": 1,
           "version": 0, "fragment_versions": [0] * fragments, "fragment_weights": [1.0] * fragments,
           "fragment_hashes": ["f" * 16] * fragments, "schedule_step": 1, "tokens": 1, "tokens_per_s": 1.0,
           "loss": None, "held_out_loss": None, "rounds": 0, "rounds_skipped": 0, "forks_healed": 0,
           "tokens_lost": 0, "goodput": 1.0, "blocked_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "rejected": 0,
           "rejected_by_kind": {}, "clipped": 0, "time": float(get_dht_time()), "reachable": True}
    rec.update(changes)
    return rec


def busy_progress(**changes) -> dict:
    """A progress record of a daemon some way into a run (every figure other than zero), for readers' checks."""
    return progress(**{
        "step": 10, "version": 2, "fragment_versions": [2], "fragment_weights": [1024.0], "fragment_hashes": ["abc"],
        "schedule_step": 3, "tokens": 4096, "tokens_per_s": 100.0, "loss": 2.5, "rounds": 2, "goodput": 0.9,
        "blocked_s": 1.5, "bytes_sent": 10, "bytes_received": 20, "rejected_by_kind": {"shape": 2, "nonfinite": 1},
        "clipped": 3, **changes})


def forged_progress(peer_id: str, version: int) -> dict:
    """A progress record claiming a replica far ahead and heavy, that passes the run's schema: only membership (the
    signer's certificate, the revocation list) can refuse it."""
    return progress(peer_id, step=10_000, version=version, fragment_versions=[version], fragment_weights=[1e12],
                    schedule_step=10_000)


def progress_record(peer_id: str, versions: list[int], hashes: list[str]) -> ProgressRecord:
    """A parsed decoupled progress record holding one replica per fragment: ``versions[p]`` of digest
    ``hashes[p]``, of weight its version."""
    return ProgressRecord(**progress(peer_id, algorithm="decoupled", version=sum(versions),
                                     fragment_versions=versions, fragment_weights=[float(v) for v in versions],
                                     fragment_hashes=hashes, time=1.0))
