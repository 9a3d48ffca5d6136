"""SIGTERM or SIGINT to a daemon's whole process group (what systemd and a terminal's Ctrl-C send) ends it cleanly:
exit 0, a final checkpoint, and no process of the group left (hivemind's DHT process and p2pd included)."""

import os
import signal
import time

import pytest
from scripts.swarm import LocalSwarm, group_alive, wait_for

from atoll.node.home.checkpoint import load_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.waits]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_ends_the_daemon_cleanly(tmp_path, sig):
    with LocalSwarm(tmp_path, ["--model", "nano", "--batch-size", "2", "--open", "--heartbeat", "1"]) as swarm:
        d = swarm.start("a", join=False)
        wait_for(lambda: any("step" in m and "event" not in m and m["step"] >= 20 for m in d.metrics()), 120, "20 steps")
        pgid = os.getpgid(d.proc.pid)
        start = time.monotonic()
        os.killpg(pgid, sig)
        # Bound: finish the step, announce leaving (its DHT process is gone too: that gives up after a few
        # seconds), one checkpoint write, the interpreter's exit; on a shared 2-core machine.
        code = d.proc.wait(40)
        took = time.monotonic() - start
        wait_for(lambda: not group_alive(pgid), 10, "the process group to be gone")
    assert code == 0, d.log()[-2000:]
    assert "stopped at step" in d.log()
    _, meta = load_checkpoint(d.workdir)
    assert meta["step"] >= 20
    print(f"{signal.Signals(sig).name} to the group: exit 0 after {took:.1f} s")
