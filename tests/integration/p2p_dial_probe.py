"""One side of a simultaneous dial: a libp2p daemon (hivemind's p2pd, started as a daemon starts it) that writes its
address to MINE, reads the other side's from THEIRS, then the wall-clock time in the file AT (which the test
writes once both sides wrote their addresses), dials at that time (both sides use one clock: the dials cross on the
link) and prints the wall-clock instant it asked p2pd to dial, then ``connected`` or ``failed: ...`` (``late``: it
read AT after that time). It raises its own priority where it may (root), as its p2pd inherits it: on a loaded
machine a late wake-up would keep the dials from crossing, and then there is nothing to test.

    python p2p_dial_probe.py HOST MINE THEIRS AT
"""

import asyncio
import os
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from atoll.protocols.dht_setup import apply_p2pd_environment


async def main(host: str, mine: Path, theirs: Path, at_file: Path) -> None:
    try:
        os.nice(-10)
    except PermissionError:
        pass
    apply_p2pd_environment()
    p2p = await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"])
    try:
        (address,) = [str(m) for m in await p2p.get_visible_maddrs()]
        mine.write_text(address)
        while not theirs.exists() or not theirs.read_text():
            await asyncio.sleep(0.02)
        addr, _, peer = theirs.read_text().partition("/p2p/")
        while not at_file.exists():
            await asyncio.sleep(0.02)
        at = float(at_file.read_text())
        if time.time() > at:  # both sides were not ready in time: the dials would not cross
            print("late", flush=True)
            return
        await asyncio.sleep(max(0.0, at - time.time() - 0.05))
        while time.time() < at:  # the last 50 ms spinning: a timer wakes up late under load
            pass
        print(f"dialed {time.time():.6f}", flush=True)
        try:
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(addr)]), 10)
            print("connected", flush=True)
        except Exception as e:  # what libp2p says is the result
            print(f"failed: {e!r}", flush=True)
        await asyncio.sleep(1.0)  # the other side may still be using this connection
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])))
