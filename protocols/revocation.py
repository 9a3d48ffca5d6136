"""A private run's revocation lists: which members the run key revoked (``atoll revoke``), as a list signed by
the run key with a serial that only grows, stored in the DHT and kept beside the run key. Daemons refuse a revoked
member's records and requests from the newest list they hold (``newest_revocation``)."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from .auth import RunKey, signed_by
from .identity import is_peer_id
from .records import MAX_EXPIRY

REVOCATION_TTL = MAX_EXPIRY["revoked"] - 60.0  # a revocation outlives the daemons that know it (and is kept on disk)

REVOCATION_FORMAT = "atoll-revoked-1"
MAX_REVOKED = 1024


@dataclass(frozen=True)
class RevocationList:
    """The run key's list of revoked members (their peer ids, i.e. member keys: see ``peer_id_of``). ``serial``
    only grows: a reader keeps the list of the highest serial it saw signed by the run key, so replaying an older
    list (which any member can, it is public) takes nobody off it."""

    run_id: str
    serial: int
    revoked: tuple[str, ...]
    time: float
    signature: bytes = b""

    def payload(self) -> bytes:
        return msgpack.packb([REVOCATION_FORMAT, self.run_id, self.serial, sorted(self.revoked), self.time],
                             use_bin_type=True)

    def signed(self, key: RunKey) -> RevocationList:
        return RevocationList(self.run_id, self.serial, tuple(sorted(set(self.revoked))), self.time,
                              key.sign(self.payload()))

    def to_record(self) -> dict:
        return {"serial": self.serial, "revoked": sorted(self.revoked), "time": self.time,
                "signature": self.signature}

    @classmethod
    def parse(cls, run_id: str, value: object) -> RevocationList | None:
        """The list a DHT value holds, or None if malformed (its signature is not checked here: ``verify``)."""
        if not isinstance(value, dict) or set(value) != {"serial", "revoked", "time", "signature"}:
            return None
        serial, revoked, time_, signature = value["serial"], value["revoked"], value["time"], value["signature"]
        if not (type(serial) is int and 0 < serial < 2**62 and isinstance(revoked, list)
                and len(revoked) <= MAX_REVOKED and all(is_peer_id(p) for p in revoked)
                and len(set(revoked)) == len(revoked) and revoked == sorted(revoked)
                and isinstance(time_, float) and isinstance(signature, bytes) and len(signature) == 64):
            return None
        return cls(run_id, serial, tuple(revoked), time_, signature)

    def verify(self, run_public_key: bytes) -> bool:
        return signed_by(run_public_key, self.payload(), self.signature)


def newest_revocation(run_id: str, run_public_key: bytes, values: list, current: RevocationList | None = None
                      ) -> tuple[RevocationList | None, int]:
    """The highest-serial list among ``values`` (and ``current``) signed by the run key, and how many values were
    malformed or not signed by it."""
    best, bad = current, 0
    for value in values:
        rec = RevocationList.parse(run_id, value)
        if rec is None or not rec.verify(run_public_key):
            bad += 1
        elif best is None or rec.serial > best.serial:
            best = rec
    return best, bad
