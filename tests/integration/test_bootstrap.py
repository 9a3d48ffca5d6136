"""A daemon whose bootstrap peers cannot be reached exits with one error line and code 2."""

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.waits]


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


def test_a_daemon_pointed_at_peers_without_its_run_refuses_instead_of_starting_one(tmp_path):
    """A restarted daemon of a chaos run that could not read the run's config in 5 s started a run of its own at
    its peers and trained alone on its checkpoint, a fork. Pointed at peers, a daemon joins their run or exits."""
    from scripts.swarm import LocalSwarm

    with LocalSwarm(tmp_path / "swarm", ["--model", "nano", "--batch-size", "2", "--open"]) as swarm:
        host = swarm.start("a", join=False)
        out = subprocess.run(
            [sys.executable, "-m", "atoll.node.cli", "start", "--initial-peers", host.maddrs[0], "--host-maddrs",
             "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path / "b"), "--run-id", "another", "--open",
             "--config-wait", "3"],
            capture_output=True, text=True, timeout=180,
        )
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == "atoll: error: initial_peers: no run 'another' found there in 3 s; check --run-id, or pass " \
                   "--new-run to start a new run there"
    assert "starting a new" not in out.stderr


def test_a_taken_metrics_port_fails_before_joining(tmp_path):
    """The metrics port is bound before the DHT: taken, it is one error line at once, not after a join (or, as
    here, after three attempts to reach a dead bootstrap peer)."""
    import socket

    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmTt18CRK6oG1T7ZZcNcypAuQXGM92vRXWthaDYPaUFgh7"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "atoll.node.cli", "start", "--initial-peers", dead, "--host-maddrs",
             "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path), "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"atoll: error: metrics_port: cannot listen on 127.0.0.1:{port}")
    assert "bootstrap" not in out.stderr  # it never tried to join
