"""A peer view for matchmaking's unit tests (``protocols.matchmaking.PeerView``): fixed live peers, no DHT."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from atoll.protocols.matchmaking import PeerView


class Peers(PeerView):
    """``live``: the live peers' versions (a dict, or a function or coroutine function returning one, called at
    every refresh);
    ``look_up(peer_ids)``: a coroutine the view calls for registrants it does not list; ``shunned(peer)``."""

    def __init__(self, live: dict[str, int] | Callable[[], Any],
                 look_up: Callable[[set[str]], Awaitable[None]] | None = None,
                 shunned: Callable[[str], bool] = lambda peer: False) -> None:
        self._live, self._look_up, self._shunned = live, look_up, shunned

    async def live(self) -> dict[str, int]:
        if not callable(self._live):
            return dict(self._live)
        got = self._live()
        return dict(await got if inspect.isawaitable(got) else got)

    async def look_up(self, peer_ids: set[str]) -> bool:
        if self._look_up is None:
            return False
        await self._look_up(peer_ids)
        return True

    def shunned(self, peer_id: str) -> bool:
        return self._shunned(peer_id)
