"""What a peer can make this daemon hold before it is known to be a member: bounded frames, streams and waits.

Every stream a peer opens to one of our handlers arrives as a unix-socket connection from p2pd to this process,
and hivemind (1.1.12) reads it with ``P2P.receive_raw_data``: a sender-chosen 8-byte length, then that many
bytes, buffered whole before atoll sees the message (one frame declaring 1 GiB took a daemon from 451 MB to
2.5 GB). hivemind has no setting for either, so this module works below its reader. The contract:

- **Frames** (``install``): every length-prefixed frame read in this process, by our handlers and by the stubs
  reading other daemons' answers, declares at most ``MAX_FRAME_BYTES`` (atoll's largest message: an envelope of
  ``wire.MAX_MESSAGE_BYTES``, plus protobuf framing). A larger declaration is refused before anything is
  buffered and the stream is closed. This replaces ``hivemind.p2p.P2P.receive_raw_data`` (a staticmethod that
  ``P2P.receive_protobuf`` looks up on the class for every message): a monkeypatch, because the read sits inside
  hivemind's stream loop and no hook reaches it. ``install`` fails loudly if hivemind's shape changed.
- **Streams** (``StreamGuard.attach``): at most ``MAX_STREAMS_PER_PEER`` open streams per peer and ``MAX_STREAMS``
  in all, of which at most ``MAX_STRANGER_STREAMS`` from peers without a progress record (strangers cannot
  crowd members out). A stream's first message must arrive whole within ``FIRST_MESSAGE_TIMEOUT`` or the
  stream is closed. In a private run a stranger's stream is served only once ``MemberGate`` finds its record,
  before hivemind reads any of it. An idle or refused stream thus costs O(1) memory and one fd for a bounded time.
- **Membership checks** (``MemberGate``): looking for an unknown peer's record may wait (``PeerTable.is_member``,
  up to 3 s). A peer is looked up once at a time: its other streams wait for that lookup's answer (a joiner
  opens its fragment downloads at once, often before the donor's table holds its record). At most
  ``MAX_CHECKS`` peers are looked up at once, and further unknown peers are refused at once. Peers already in
  the table never wait.

Peers are named by ``StreamInfo.peer_id``, which libp2p authenticated. Refusals are counted
(``frame_too_large``, ``stream_limit``, ``first_message_timeout``, ``unauthorized``, ``member_check_limit``) and
logged at most once per kind every ``LOG_EVERY`` seconds. Everything here runs on the protocol event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P

from .wire import MAX_MESSAGE_BYTES

logger = logging.getLogger("atoll")

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + 64 * 1024  # protobuf's field tags and lengths around the envelope: bytes
MAX_STREAMS_PER_PEER = 32  # an honest peer has one per round it is in with us (fragments, retries) and a download
MAX_STREAMS = 256  # a 1024-fd limit keeps room for the DHT, checkpoints and p2pd's own control connections
MAX_STRANGER_STREAMS = 32  # peers not (yet) in the peer table: joiners asking for state, and outsiders
FIRST_MESSAGE_TIMEOUT = 10.0  # seconds; an honest stub writes its first message as it opens the stream
MAX_CHECKS = 16
LOG_EVERY = 10.0  # seconds between log lines of one refusal kind

Reject = Callable[[str, "str | None"], Any]  # TrafficStats.reject: (kind, offender or None)
StreamHandler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class FrameTooLarge(asyncio.IncompleteReadError):
    """A frame declared more than ``MAX_FRAME_BYTES``. An ``IncompleteReadError``, because that is what hivemind's
    handler and stub loops take as "the stream ended": they close the stream quietly, without a traceback."""

    def __init__(self, declared: int) -> None:
        super().__init__(b"", declared)
        self.declared = declared

    def __str__(self) -> str:
        return f"a frame declared {self.declared} bytes, more than the {MAX_FRAME_BYTES} allowed"


def frame_allowed(declared: int, cap: int = MAX_FRAME_BYTES) -> bool:
    """Whether a frame of ``declared`` bytes may be read (and buffered)."""
    return 0 <= declared <= cap


class _Watch:
    """What the frame reader reports about one guarded incoming stream."""

    def __init__(self, guard: StreamGuard, peer: str) -> None:
        self.guard, self.peer = guard, peer
        self.first = asyncio.Event()  # set once the stream's first frame arrived whole


_watched: weakref.WeakKeyDictionary[asyncio.StreamReader, _Watch] = weakref.WeakKeyDictionary()
_unwatched_log: RateLimitedLog | None = None


async def bounded_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    """``P2P.receive_raw_data`` with the declared length checked before the frame is read."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    declared = int.from_bytes(header, P2P.BYTEORDER)
    watch = _watched.get(reader)
    if not frame_allowed(declared):
        error = FrameTooLarge(declared)
        if watch is not None:
            watch.guard.refuse("frame_too_large", watch.peer, error, offence=True)
        elif _unwatched_log is not None:  # an answer to one of our stubs: the caller sees a stream that ended
            _unwatched_log("frame_too_large", "closed a stream: %s", error)
        raise error
    data = await reader.readexactly(declared)
    if watch is not None:
        watch.first.set()
    return data


def install() -> None:
    """Bound every frame read in this process (idempotent). Raises RuntimeError if hivemind no longer reads its
    frames through ``P2P.receive_raw_data``: running unbounded would be worse than not starting."""
    global _unwatched_log
    original = inspect.getattr_static(P2P, "receive_raw_data", None)
    code = getattr(getattr(P2P, "receive_protobuf", None), "__code__", None)
    if (not isinstance(original, staticmethod) or code is None or "receive_raw_data" not in code.co_names
            or not isinstance(getattr(P2P, "HEADER_LEN", None), int) or not hasattr(P2P, "BYTEORDER")):
        raise RuntimeError("p2p_guard: hivemind's P2P no longer reads frames through a staticmethod receive_raw_data "
                           "called by receive_protobuf; the frame bound cannot be installed (see protocols/p2p_guard.py)")
    if original.__func__ is bounded_receive_raw_data:
        return
    _unwatched_log = RateLimitedLog()
    P2P.receive_raw_data = staticmethod(bounded_receive_raw_data)


class RateLimitedLog:
    """A warning per ``key`` at most every ``every`` seconds, saying how many were not logged in between."""

    def __init__(self, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def __call__(self, key: str, message: str, *args: Any) -> bool:
        """Log ``message % args`` unless ``key`` was logged less than ``every`` seconds ago; True if logged."""
        now = self.clock()
        if now - self._last.get(key, -self.every) < self.every:
            self._quiet[key] = self._quiet.get(key, 0) + 1
            return False
        self._last[key] = now
        quiet = self._quiet.pop(key, 0)
        logger.warning(message + (f" ({quiet} more like it not logged)" if quiet else ""), *args)
        return True


class StreamLimits:
    """Counts of open streams per peer, in all, and from strangers (peers without a progress record)."""

    def __init__(self, per_peer: int = MAX_STREAMS_PER_PEER, total: int = MAX_STREAMS,
                 strangers: int = MAX_STRANGER_STREAMS) -> None:
        self.per_peer, self.total, self.strangers = per_peer, total, strangers
        self.open: dict[str, int] = {}  # only peers with an open stream: at most ``total`` entries
        self.open_total = 0
        self.open_strangers = 0

    def admit(self, peer: str, member: bool) -> bool:
        """Count a new stream of ``peer`` if every limit allows it; ``release`` it with the same ``member``."""
        if (self.open.get(peer, 0) >= self.per_peer or self.open_total >= self.total
                or (not member and self.open_strangers >= self.strangers)):
            return False
        self.open[peer] = self.open.get(peer, 0) + 1
        self.open_total += 1
        self.open_strangers += not member
        return True

    def release(self, peer: str, member: bool) -> None:
        left = self.open[peer] - 1
        if left:
            self.open[peer] = left
        else:
            del self.open[peer]
        self.open_total -= 1
        self.open_strangers -= not member


class MemberGate:
    """Private runs: whether a peer is a member, with the waits for an unknown peer's record bounded.

    ``known(peer)``: already in the peer table (answered at once); ``look(peer)``: looks for its record, may wait
    (``PeerTable.is_member``). ``check`` returns None for a member, else the refusal's kind. Concurrent checks
    of one peer share one lookup; at most ``total`` peers are looked up at once."""

    def __init__(self, known: Callable[[str], bool], look: Callable[[str], Awaitable[bool]],
                 total: int = MAX_CHECKS) -> None:
        self.known, self.look, self.total = known, look, total
        self.lookups: dict[str, asyncio.Future[bool]] = {}

    async def check(self, peer: str) -> str | None:
        if self.known(peer):
            return None
        lookup = self.lookups.get(peer)
        if lookup is None:
            if len(self.lookups) >= self.total:
                return "member_check_limit"
            lookup = self.lookups[peer] = asyncio.ensure_future(self._look(peer))
        # shield: a stream that closes while it waits must not cancel the lookup its peer's other streams share
        return None if await asyncio.shield(lookup) else "unauthorized"

    async def _look(self, peer: str) -> bool:
        try:
            return await self.look(peer)
        finally:
            del self.lookups[peer]

    async def is_member(self, peer: str) -> bool:
        """``check`` as a yes/no, for the servicers' ``authorize``."""
        return await self.check(peer) is None


class StreamGuard:
    """Applies ``StreamLimits``, the first-message deadline and (private runs) ``MemberGate`` to every incoming
    stream of the handlers registered on a P2P instance after ``attach``. ``arrived`` hears of each such stream
    that reaches this process: p2pd hands a stream over through a unix-socket connection (hivemind listens with
    asyncio's default backlog of 100), and one it cannot hand over is reset without atoll seeing it."""

    def __init__(self, reject: Reject, known: Callable[[str], bool] = lambda peer: True,
                 gate: MemberGate | None = None, limits: StreamLimits | None = None,
                 first_message_timeout: float = FIRST_MESSAGE_TIMEOUT,
                 arrived: Callable[[], Any] = lambda: None) -> None:
        self.reject, self.known, self.gate, self.arrived = reject, known, gate, arrived
        self.limits = limits or StreamLimits()
        self.first_message_timeout = first_message_timeout
        self.log = RateLimitedLog()

    def attach(self, p2p: P2P) -> None:
        """Guard the stream handlers registered on ``p2p`` from now on. Wraps this instance's
        ``add_binary_stream_handler``, the one call through which hivemind registers protobuf stream handlers
        (``ServicerBase.add_p2p_handlers``); hivemind's unary handlers do not use streams."""
        if getattr(p2p, "_atoll_guard", None) is not None:
            raise RuntimeError("p2p_guard: this P2P instance is already guarded")
        register = p2p.add_binary_stream_handler

        async def add_binary_stream_handler(name: str, handler: StreamHandler, balanced: bool = False) -> None:
            await register(name, self.wrap(handler), balanced)

        p2p.add_binary_stream_handler = add_binary_stream_handler  # type: ignore[method-assign]
        p2p._atoll_guard = self  # type: ignore[attr-defined]

    def wrap(self, handler: StreamHandler) -> StreamHandler:
        async def guarded(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self.serve(handler, info, reader, writer)
            finally:
                writer.close()  # a refused or timed-out stream gives its fd back at once

        return guarded

    def refuse(self, kind: str, peer: str, reason: Any, offence: bool = False) -> None:
        """Count a refusal (``offence``: content a correct peer never sends, so its sender cools down) and log it,
        rate-limited per kind."""
        self.reject(kind, peer if offence else None)
        self.log(kind, "refused a stream of %s (%s): %s", peer[-8:], kind, reason)

    async def serve(self, handler: StreamHandler, info: Any, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        self.arrived()
        peer = str(info.peer_id)
        member = self.known(peer)
        if not self.limits.admit(peer, member):
            self.refuse("stream_limit", peer, f"{self.limits.open.get(peer, 0)} open from it, "
                                              f"{self.limits.open_total} in all, {self.limits.open_strangers} "
                                              f"from peers without a record")
            return
        try:
            if not member and self.gate is not None:
                kind = await self.gate.check(peer)  # before hivemind reads anything of the stream
                if kind is not None:
                    self.refuse(kind, peer, "not a member of this private run")
                    return
            watch = _Watch(self, peer)
            _watched[reader] = watch
            task = asyncio.ensure_future(handler(info, reader, writer))
            first = asyncio.ensure_future(watch.first.wait())
            try:
                await asyncio.wait({task, first}, timeout=self.first_message_timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not task.done() and not watch.first.is_set():
                    self.refuse("first_message_timeout", peer,
                                f"no whole first message within {self.first_message_timeout:g} s")
                    # Closing (not cancelling) ends it: hivemind's read loop sees the stream end and returns, with
                    # its pending read finished (a cancelled handler would leave that read behind).
                    writer.close()
                await task
            finally:
                first.cancel()
                if not task.done():  # we were cancelled ourselves (shutdown)
                    task.cancel()
        finally:
            _watched.pop(reader, None)
            self.limits.release(peer, member)
