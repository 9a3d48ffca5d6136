"""Deterministic fault injection: the one place that knows which faults exist.

Tests and ``scripts/chaos.py`` pass ``--fault NAME=VALUE`` (``NodeConfig.faults``). The product attaches to this
module only through the hooks of ``Faults`` (``before_step``, ``namespace``, ``group_formed``, ``tamper``, ...);
a daemon without faults gets ``Faults()``, whose hooks do nothing, so no production path branches on a fault.

The faults, each triggered by the daemon's own step or round count (never by a clock):

- ``kill_in_round=N``: SIGKILL this daemon's process group (its DHT child and p2pd too) once the group of its
  N-th merged round has formed.
- ``corrupt_round=N``: from the N-th multi-member round on, send malformed parts (truncated, bad header,
  unknown codec, NaN), each kind until it has reached two completed rounds.
- ``split_side=S`` with ``split_until=N``: until step N the daemon sees and meets only daemons of side S (a split
  swarm whose halves meet again later).
- ``byzantine=K`` (scale, nan, shape, direction, edge, weight) from the ``byzantine_from``-th multi-member round
  on (default 1): ``scale`` sends the delta ×1000, ``nan`` parts holding NaN, ``shape`` parts one block short,
  ``direction`` the negated delta (the honest norm, the opposite direction: what the norm clip cannot see),
  ``edge`` the negated delta at ``EDGE_FACTOR`` × its norm declaring ``EDGE_FACTOR`` × its token weight (each just
  inside the clip, the second review's attack), ``weight`` the negated delta at its honest norm declaring
  ``EDGE_FACTOR`` × its token weight (the weight lie alone, which the run's bound on a weight cuts:
  ``Algorithm.weight_bound``) (the daemon still reduces its own shard honestly).
- ``reducer=K`` (scale, silent): the shards this daemon reduces leave it hostile (it merges honestly itself):
  ``scale`` answers every member with the reduced shard ×``REDUCER_SCALE`` under honest scalars, ``silent`` holds
  every member's stream open without an answer (the second review's reducer attacks).
- ``kill_in_checkpoint=N``: SIGKILL the process group in the middle of the N-th checkpoint write (the tensors'
  temporary file half written); ``checkpoint_kill_signal=1``: SIGUSR1 arms the same crash for the next write.
- ``slow_checkpoint=S``: each checkpoint write takes S seconds longer (a slow disk), held in the middle of it.
- ``kill_rank=R`` with ``kill_rank_at=S``: in an island of several ranks, rank R SIGKILLs its process group (for
  rank 0: its DHT child and p2pd too) before its step S+1, in the launcher's first attempt only (a restarted island,
  which resumes from an earlier step, does not die again).

A benchmark's settings that make runs compare (a step delay, a common start, a pinned data shard) are not faults:
they are ``--harness`` settings (``node/harness.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from atoll.protocols import codecs
from atoll.protocols.averaging import HONEST, Tamper
from atoll.protocols.reducer import Answer, GroupSpec

from .harness import KINDS as HARNESS_KINDS
from .harness import parse_items

logger = logging.getLogger("atoll")

SPLIT_SIDES = 4  # a split swarm's sides: namespaces ``<run>-side{0..3}``

KINDS: dict[str, type] = {"kill_in_round": int, "corrupt_round": int, "split_side": int, "split_until": int,
                          "byzantine": str, "byzantine_from": int, "kill_in_checkpoint": int,
                          "checkpoint_kill_signal": int, "kill_rank": int, "kill_rank_at": int,
                          "slow_checkpoint": float, "reducer": str}
BYZANTINE = ("scale", "nan", "shape", "direction", "edge", "weight")
REDUCERS = ("scale", "silent")
REDUCER_SCALE = -5.0
CORRUPTIONS = ("truncated", "header", "codec", "nan")
BYZANTINE_SCALE = 1000.0
EDGE_FACTOR = 3.0  # below the default clip factor (4): neither the norm clip nor the weight clip alone fires


def parse_faults(items: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings as a dict of typed values; ``ValueError`` with one line naming the bad item."""
    for item in items:
        name = item.partition("=")[0]
        if name in HARNESS_KINDS:
            raise ValueError(f"{name} is a harness setting, not a fault: --harness {item}")
    out = parse_items(items, KINDS, "fault")
    for name, value in out.items():
        if name == "byzantine" and value not in BYZANTINE:
            raise ValueError(f"unknown byzantine kind {value!r}; known: {', '.join(BYZANTINE)}")
        if name == "reducer" and value not in REDUCERS:
            raise ValueError(f"unknown reducer kind {value!r}; known: {', '.join(REDUCERS)}")
        if name == "split_side" and not 0 <= out[name] < SPLIT_SIDES:
            raise ValueError(f"split_side must be 0 to {SPLIT_SIDES - 1}, got {value}")
    return out


def corrupt_payload(payload: bytes, kind: str) -> bytes:
    """A malformed variant of ``payload`` (what a buggy or hostile peer might send)."""
    if kind == "truncated":
        return payload[: len(payload) // 2]
    if kind == "header":
        return b"XXXX" + payload[4:]
    if kind == "codec":
        return payload[:5] + bytes([99]) + payload[6:]  # the codec id byte
    if kind == "nan":
        return payload[:20] + struct.pack("<f", float("nan")) + payload[24:]
    raise ValueError(f"unknown corruption {kind!r}")


def byzantine_payload(flat: torch.Tensor, lo: int, hi: int, codec: str, block: int, kind: str) -> bytes:
    """What a hostile member sends as its part ``flat[lo:hi]`` (``nan``: NaN in the values or scales; ``shape``: a
    well-formed payload one block short of the shard, under a header that claims the right size). ``scale`` is
    applied to the whole delta (``Scaled``), so its parts are valid."""
    if kind == "nan":
        return corrupt_payload(codecs.encode(flat[lo:hi].float(), codec, block), "nan")
    if kind == "shape":
        return codecs.encode(flat[lo : max(lo, hi - block)].float(), codec, block)
    raise ValueError(f"unknown byzantine kind {kind!r}")


class Corrupted(Tamper):
    """Every part sent is malformed in the same way."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def part(self, payload: bytes, flat: torch.Tensor, lo: int, hi: int, spec: GroupSpec) -> bytes:
        return corrupt_payload(payload, self.kind)


class Hostile(Tamper):
    """A member whose parts are well framed but hold NaN (``nan``) or the wrong number of values (``shape``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def part(self, payload: bytes, flat: torch.Tensor, lo: int, hi: int, spec: GroupSpec) -> bytes:
        return byzantine_payload(flat, lo, hi, spec.codec, spec.block, self.kind)


class Scaled(Tamper):
    """A member that claims ×``BYZANTINE_SCALE`` its delta, every round."""

    def delta(self, flat: torch.Tensor) -> torch.Tensor:
        return flat * BYZANTINE_SCALE

    def own(self, sent: torch.Tensor) -> torch.Tensor:
        # Error feedback must keep only what quantization dropped; keeping the scaled remainder would turn the
        # next rounds into large steps against our own progress.
        return sent / BYZANTINE_SCALE


class Reversed(Tamper):
    """A member that claims the negation of its delta, every round: its norm is honest, its direction hostile."""

    def delta(self, flat: torch.Tensor) -> torch.Tensor:
        return -flat

    def own(self, sent: torch.Tensor) -> torch.Tensor:
        return -sent  # error feedback keeps what quantization dropped of the honest delta, as for ``Scaled``


class Edge(Tamper):
    """A member that claims ``EDGE_FACTOR`` × the negation of its delta and ``EDGE_FACTOR`` × its token weight."""

    def delta(self, flat: torch.Tensor) -> torch.Tensor:
        return flat * -EDGE_FACTOR

    def weight(self, weight: float) -> float:
        return weight * EDGE_FACTOR

    def own(self, sent: torch.Tensor) -> torch.Tensor:
        return sent / -EDGE_FACTOR


class Heavy(Reversed):
    """A member that claims the negation of its delta at its honest norm and ``EDGE_FACTOR`` × its token weight."""

    def weight(self, weight: float) -> float:
        return weight * EDGE_FACTOR


class ScaledAnswer(Answer):
    """A reducer that answers with its reduced shard ×``REDUCER_SCALE`` (the scalars it sends stay honest)."""

    async def payload(self, payload: bytes, spec: GroupSpec, timeout: float) -> bytes | None:
        logger.warning("fault injection: answering round f%d v%d with the reduced shard x%g", spec.fragment,
                       spec.version, REDUCER_SCALE)
        values = codecs.decode(payload) * REDUCER_SCALE
        return codecs.encode(values, spec.codec, spec.block)


class SilentAnswer(Answer):
    """A reducer that never answers: each member's stream is held open until it gives up."""

    async def payload(self, payload: bytes, spec: GroupSpec, timeout: float) -> bytes | None:
        logger.warning("fault injection: holding round f%d v%d's answer", spec.fragment, spec.version)
        await asyncio.sleep(3 * timeout + 10)  # longer than any member waits for it
        return None


class Faults:
    """The hooks through which injected faults reach a daemon; ``Faults()`` injects nothing."""

    def __init__(self, items: Sequence[str] = ()) -> None:
        self.spec = parse_faults(items)
        self.rounds_attempted = 0  # multi-member groups this daemon was in (the schedules count these)
        self.corrupt_delivered = 0  # rounds whose malformed parts reached a group that completed
        self._checkpoint_kill_armed = False

    # ---- the daemon ---------------------------------------------------------------------------------------
    def install_signals(self) -> None:
        """``checkpoint_kill_signal``: SIGUSR1 arms a crash in the middle of the next checkpoint write."""
        if self.spec.get("checkpoint_kill_signal"):

            def arm(_signum: int, _frame: Any) -> None:
                self._checkpoint_kill_armed = True

            signal.signal(signal.SIGUSR1, arm)

    def island_step(self, rank: int, step: int) -> None:
        """Rank ``rank`` of an island is about to train step ``step`` + 1."""
        if (self.spec.get("kill_rank") == rank and self.spec.get("kill_rank_at") == step
                and os.environ.get("ATOLL_ISLAND_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == "0"):
            logger.warning("fault injection: killing rank %d of this island at step %d", rank, step)
            _flush_logs()
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def checkpoint_interrupt(self, number: int) -> Callable[[Path], None] | None:
        """What to do to the ``number``-th checkpoint's half-written tensors file (None: nothing)."""
        if self._checkpoint_kill_armed or self.spec.get("kill_in_checkpoint") == number:
            return lambda tmp: _die_mid_write(tmp, number)
        slow = self.spec.get("slow_checkpoint", 0.0)
        if slow:
            return lambda tmp: time.sleep(slow)
        return None

    # ---- the syncer ---------------------------------------------------------------------------------------
    def namespace(self, run_id: str, step: int) -> str:
        """Where this daemon's records and rounds live: its side of a split swarm until ``split_until``."""
        side = self.spec.get("split_side")
        if side is not None and step < self.spec.get("split_until", 0):
            return f"{run_id}-side{side}"
        return run_id

    def namespaces(self, run_id: str) -> tuple[str, ...]:
        """The namespaces other than the run's whose records this daemon's DHT node must accept: every side's, when
        the swarm is split (a node of one side stores records of the others: the DHT itself is not split)."""
        if self.spec.get("split_side") is None:
            return ()
        return tuple(f"{run_id}-side{side}" for side in range(SPLIT_SIDES))

    def group_formed(self, rounds_done: int, version: int) -> None:
        """A round's group formed; ``rounds_done`` rounds have merged before it."""
        if self.spec.get("kill_in_round") == rounds_done + 1:
            logger.warning("fault injection: killing this daemon (and its DHT and p2pd) in round v%d", version)
            _flush_logs()
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def tamper(self, group_size: int, p: int, version: int) -> Tamper:
        """How this daemon's contribution to a round of ``group_size`` members leaves it."""
        if group_size < 2:  # a solo round sends nothing, so it cannot carry a fault
            return HONEST
        self.rounds_attempted += 1
        first_bad = self.spec.get("corrupt_round")
        # Each kind must reach the group twice. A round whose group the others refused (they had this daemon
        # cooling down after its previous offence) delivered nothing, so its kind is sent again.
        index = self.corrupt_delivered if first_bad is not None and self.rounds_attempted >= first_bad else -1
        tamper: Tamper = HONEST
        if 0 <= index < 2 * len(CORRUPTIONS):
            tamper = Corrupted(CORRUPTIONS[index % len(CORRUPTIONS)])
            logger.warning("fault injection: sending %s parts in round f%d v%d", tamper.kind, p, version)
        kind = self.spec.get("byzantine")
        if kind is not None and self.rounds_attempted >= self.spec.get("byzantine_from", 1):
            logger.warning("fault injection: byzantine (%s) contribution in round %d", kind, self.rounds_attempted)
            kinds = {"scale": Scaled, "direction": Reversed, "edge": Edge, "weight": Heavy}
            tamper = kinds.get(kind, lambda: Hostile(kind))()
        return tamper

    def answer(self) -> Answer:
        """How the shards this daemon reduces leave it."""
        kind = self.spec.get("reducer")
        return {"scale": ScaledAnswer, "silent": SilentAnswer}[kind]() if kind is not None else Answer()

    def round_ended(self, tamper: Tamper, completed: bool) -> None:
        """The all-reduce that carried ``tamper``'s parts ended (``completed``: its group merged)."""
        if isinstance(tamper, Corrupted) and completed:
            self.corrupt_delivered += 1
            if self.corrupt_delivered == 2 * len(CORRUPTIONS):
                logger.warning("fault injection: malformed parts reached %d rounds; valid parts from now on",
                               self.corrupt_delivered)


def _flush_logs() -> None:
    for h in logger.handlers:
        h.flush()


def _die_mid_write(tmp: Path, number: int) -> None:
    """A crash while the checkpoint's tensors are only half on disk."""
    size = tmp.stat().st_size
    with open(tmp, "r+b") as f:
        f.truncate(size // 2)
    logger.warning("fault injection: killing this daemon in the middle of checkpoint %d (%s, %d of %d bytes)",
                   number, tmp.name, size // 2, size)
    _flush_logs()
    os.killpg(os.getpgid(0), signal.SIGKILL)
