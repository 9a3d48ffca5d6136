"""A daemon whose bootstrap peers cannot be reached exits with one error line and code 2."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_unreachable_bootstrap_peer_exits_2(tmp_path):
    # A well-formed multiaddr of a peer that does not exist (nothing listens on port 9 of loopback).
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmTt18CRK6oG1T7ZZcNcypAuQXGM92vRXWthaDYPaUFgh7"
    out = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "start", "--initial-peers", dead, "--host-maddrs",
         "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("atoll: error: initial_peers: could not reach any bootstrap peer after 3 attempts")
