"""A run whose daemons all left is not started over from the seed by the next newcomer: it waits for a holder of
the run's state and says so, then gives up with one line (exit 2); ``--restart-run`` starts it over on purpose."""

import subprocess
import sys

import pytest
from hivemind import DHT
from scripts.swarm import LocalSwarm, wait_for

from atoll.protocols.record_validator import make_validators

pytestmark = [pytest.mark.integration, pytest.mark.waits]

COMMON = ["--model", "nano", "--batch-size", "2", "--open", "--sync-every", "10", "--heartbeat", "1",
          "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def bootstrap():
    """A DHT node that outlives the run's daemons (as a bootstrap node or a dashboard would); it holds no state."""
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators("atoll"))
    try:
        yield [str(a) for a in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


def newcomer(tmp_path, name, peers, *extra):
    return subprocess.run([sys.executable, "-m", "atoll.node.cli", "start", "--initial-peers", *peers,
                           "--checkpoint-dir", str(tmp_path / name), *COMMON, *extra],
                          capture_output=True, text=True, timeout=240)


def test_a_newcomer_waits_for_the_runs_state_instead_of_starting_it_over(tmp_path, bootstrap):
    with LocalSwarm(tmp_path / "swarm", COMMON) as swarm:
        a = swarm.start("a", ["--initial-peers", *bootstrap, "--new-run"], join=False)
        wait_for(lambda: any(r["version"] >= 2 for r in a.rounds()), 120, "a few rounds")
        assert swarm.stop("a") == 0
    # Only the bootstrap node is left; it holds the run's config and head, not its state.
    out = newcomer(tmp_path, "b", bootstrap, "--state-wait", "8")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "no live daemon holds its state: waiting up to" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("atoll: error: state_wait: run 'atoll' got to version ")
    assert "starting from the seed" not in out.stderr

    out = newcomer(tmp_path, "c", bootstrap, "--restart-run", "--max-steps", "5")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "starting it over from the seed's initial model, as --restart-run asks" in out.stderr
