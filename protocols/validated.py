"""Records a DHT node has validated recently, so that it does not check the same bytes again on every read.

Every read of a key with subkeys returns its whole dictionary from each node asked, and the reader checks each
record: the owner's signature, the member's certificate, the value's shape by two parsers. A daemon reads the
progress key every heartbeat and the keys of a forming round every 0.2 s, and most of the records it gets back
are the very bytes it checked a moment ago (from another node, or at the previous poll): in a swarm of 8 daemons
those checks were about 60% of each DHT process's CPU (docs/results.md).

A record is identified by everything a validator sees (key, subkey, value with its signature, expiration), so a
remembered verdict is the verdict the validators would give again, except where they depend on the time or on
what the node learnt since:

- a verdict is remembered for ``REMEMBER_S`` seconds only, so that a member's certificate that expired stops
  counting within that time;
- a new revocation list (``forget_all``, called when one is applied) forgets every verdict at once: the revoked
  member's records are refused at their next read.

Only records that passed are remembered; a refused one is checked (and counted) again each time it is read.
Verdicts are kept per validator (a process may run DHT nodes of several runs, with different rules).
"""

from __future__ import annotations

import hashlib
import time
import weakref
from collections.abc import Callable
from typing import Any

REMEMBER_S = 10.0  # seconds a record that passed is taken as valid without checking it again
MAX_REMEMBERED = 20_000  # verdicts per validator; past this, the expired ones go, then all if none had

_generation = 0  # bumped by ``forget_all``; verdicts of an older generation no longer count


def forget_all() -> None:
    """Forget every remembered verdict, in every validator's memory (a revocation list was applied)."""
    global _generation
    _generation += 1


class Remembered:
    """The records one validator passed recently: ``(key, subkey, value digest, expiration) -> (when,
    generation)``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._passed: dict[tuple[bytes, bytes, bytes, float], tuple[float, int]] = {}
        self.hits = 0  # verdicts given from memory

    def validate(self, validator: Any, record: Any) -> bool:
        """``validator.validate(record)``, unless the same record passed it less than ``REMEMBER_S`` ago."""
        # The value by a 128-bit digest: a remembered verdict costs ~150 bytes, not the record's (up to 32 KB);
        # finding other bytes with a passed record's digest is a second preimage of BLAKE2b.
        ident = (record.key, record.subkey, hashlib.blake2b(record.value, digest_size=16).digest(),
                 record.expiration_time)
        now = self.clock()
        seen = self._passed.get(ident)
        if seen is not None and now - seen[0] < REMEMBER_S and seen[1] == _generation:
            self.hits += 1
            return True
        if not validator.validate(record):
            self._passed.pop(ident, None)
            return False
        if len(self._passed) >= MAX_REMEMBERED:
            self._passed = {k: v for k, v in self._passed.items() if now - v[0] < REMEMBER_S and v[1] == _generation}
            if len(self._passed) >= MAX_REMEMBERED:
                self._passed.clear()
        self._passed[ident] = (now, _generation)
        return True


_memories: weakref.WeakKeyDictionary[Any, Remembered] = weakref.WeakKeyDictionary()


def memory_of(validator: Any) -> Remembered:
    """The verdicts remembered for ``validator`` (created on first use; gone with the validator)."""
    memory = _memories.get(validator)
    if memory is None:
        memory = _memories[validator] = Remembered()
    return memory
