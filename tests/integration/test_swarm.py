"""A real swarm on 127.0.0.1: rounds agree bit for bit, status reports, a kill, a join, a restart.

One swarm is shared by the tests of this module, in order (each test builds on the previous state). Faults
are injected deterministically: the killed daemon kills itself in its N-th round (``--fault kill_in_round=N``).
"""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from support.swarms import assert_replicas_agree, group_alive, peer_id, wait_for
from scripts.swarm import LocalSwarm

pytestmark = pytest.mark.integration

ROUND_TIMEOUT = 8.0
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20", "--gather-timeout", "8",
          "--round-timeout", str(ROUND_TIMEOUT), "--heartbeat", "0.3",  # records fresher than a round (~0.3 s)
          "--eval-budget", "1"]  # held-out loss every round
KILL_ROUND = 25


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("swarm"), COMMON)
    try:
        s.start("a", ["--metrics-port", "0"], join=False)
        s.start("b")
        s.start("c", ["--fault", f"kill_in_round={KILL_ROUND}"])
        yield s
    finally:
        s.stop_all(timeout=30)
        for name, d in s.daemons.items():
            print(f"----- {name} -----\n{d.log()[-4000:]}")


def test_three_daemons_complete_rounds_with_identical_replicas(swarm):
    def full_rounds(name):
        return [r for r in swarm.daemons[name].rounds() if len(r["members"]) == 3]

    wait_for(lambda: all(len(full_rounds(n)) >= 3 for n in "abc"), 180, "three 3-member rounds on every daemon")
    assert_replicas_agree(swarm, "abc")
    common = set.intersection(*({r["version"] for r in full_rounds(n)} for n in "abc"))
    assert len(common) >= 3
    rounds = swarm.daemons["a"].rounds()
    assert rounds[-1]["held_out_loss"] < rounds[0]["held_out_loss"]


LISTS_HEAVY_IMPORTS = (
    "import sys\nfrom atoll.node.cli import main\nrc = main(sys.argv[1:])\n"
    "print('heavy imports:', sorted(m for m in sys.modules if m.startswith(('torch', 'atoll.models'))), file=sys.stderr)\n"
    "sys.exit(rc)")


def test_status_json_lists_all_daemons(swarm):
    out = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *swarm.bootstrap, "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["run_id"] == "atoll" and doc["config"]["model"] == "nano"
    listed = {p["peer_id"]: p for p in doc["peers"]}
    for name in "abc":
        if swarm.daemons[name].alive():
            p = listed[peer_id(swarm.daemons[name])]
            assert p["status"] == "training" and p["step"] > 0 and p["version"] >= 1 and p["tokens"] > 0
            assert p["bytes_sent"] > 0 and p["loss"] is not None
    assert doc["totals"]["peers"] >= 2 and doc["totals"]["tokens"] > 0
    # Three daemons: each is a summarizer, and the summaries' totals are what ``--no-peers`` shows.
    assert doc["summary"]["source"] == "records" and set(doc["summary"]["summarizers"]) <= set(listed)
    assert doc["summary"]["summarizers"], doc["summary"]
    # This one as a script that, once the command is done, lists on stderr what it imported of torch and the models:
    # nothing (a light command: protocols/light_import.py).
    out = subprocess.run(
        [sys.executable, "-c", LISTS_HEAVY_IMPORTS, "status", "--initial-peers", *swarm.bootstrap, "--json",
         "--no-peers"], capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "heavy imports: []", out.stderr[-2000:]
    summarized = json.loads(out.stdout)
    assert summarized["peers"] is None and summarized["summary"]["source"] == "summaries"
    assert summarized["totals"]["peers"] >= 2 and summarized["totals"]["tokens"] > 0
    # Without credentials what it read is unverified; with the run key it reads only records whose certificates
    # the run key signed, and the run's daemons' records are among them.
    assert doc["verified"] is False
    out = subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *swarm.bootstrap, "--json",
         "--run-key", str(swarm.run_key)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    verified = json.loads(out.stdout)
    assert verified["verified"] is True and verified["config"]["model"] == "nano"
    alive = {peer_id(swarm.daemons[n]) for n in "abc" if swarm.daemons[n].alive()}
    assert alive <= {p["peer_id"] for p in verified["peers"]}, (alive, verified["peers"])


def scrape(url):
    """{(name, labels): value} of every sample a Prometheus endpoint serves, as prometheus_client parses them."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint_of_a_live_daemon_moves_as_it_trains(swarm):
    d = swarm.daemons["a"]
    url = wait_for(lambda: re.findall(r"Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics)", d.log()), 60,
                   "a's metrics address")[0]
    merged = ("atoll_rounds_total", (("fragment", "0"), ("result", "merged")))
    steps, tokens = ("atoll_inner_steps_total", ()), ("atoll_tokens_total", ())
    first = scrape(url)
    assert first[("atoll_info", (("algorithm", "diloco"), ("device", "cpu"), ("peer_id", peer_id(d)),
                                 ("run_id", "atoll")))] == 1
    assert first[("atoll_status", (("status", "training"),))] == 1
    assert first[steps] > 0 and first[tokens] > 0 and first[("atoll_replica_version", (("fragment", "0"),))] >= 1
    assert first[("atoll_peers", ())] >= 1 and first[("atoll_sent_bytes_total", ())] > 0
    later = wait_for(lambda: (lambda m: m if m[merged] > first[merged] and m[steps] > first[steps] else None)(
        scrape(url)), 120, "a's metrics to show another merged round")
    assert later[tokens] > first[tokens]
    # (The histogram and the round counts are read a moment apart: a round may land in between.)
    assert later[("atoll_round_duration_seconds_count", (("fragment", "0"),))] >= 1
    version = ("atoll_replica_version", (("fragment", "0"),))
    assert later[version] > first[version]


def test_status_watch_refreshes_in_place_and_ends_cleanly_on_ctrl_c(swarm):
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 240, 0, 0))  # wide enough for the table

    def own_terminal():  # a session of its own whose controlling terminal is the pty, as a shell's job has
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *swarm.bootstrap,
                             "--watch", "1"], stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal,
                            env={**os.environ, "COLUMNS": "240", "LINES": "60"})  # rich reads these first
    os.close(slave)
    out = b""

    def read(seconds):
        nonlocal out
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the terminal closed: the process exited
                    return

    try:
        deadline = time.monotonic() + 180
        while out.count(b"since the last read") < 2 and time.monotonic() < deadline and proc.poll() is None:
            read(1)
        assert out.count(b"since the last read") >= 2, out.decode(errors="replace")[-3000:]  # refreshed twice
        assert peer_id(swarm.daemons["a"])[-8:].encode() in out
        os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to its foreground process group
        rc = proc.wait(60)
        read(1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(master)
    text = out.decode(errors="replace")
    assert rc == 0 and "Traceback" not in text, text[-3000:]
    # The DHT client's process and its p2pd ended with it.
    wait_for(lambda: not group_alive(proc.pid), 30, "status's processes to end")


def test_a_daemon_logs_json_lines_with_its_peer_id_and_step(swarm):
    d = swarm.start("j", ["--log-format", "json", "--max-steps", "40"])
    assert d.proc.wait(180) == 0, d.log()[-2000:]
    lines = [json.loads(line) for line in d.log().splitlines()]  # every line one JSON object
    assert {"time", "level", "peer_id", "step", "message"} <= set(lines[-1])
    mine = [line for line in lines if line["peer_id"] is not None]
    assert mine and all(line["peer_id"] == peer_id(d) for line in mine)
    assert any(line["message"].startswith("stopped at step") and line["step"] >= 40 for line in lines), lines[-3:]


def _start_once(swarm, *args):
    return subprocess.run(
        [sys.executable, "-m", "atoll.node.cli", "start", "--initial-peers", *swarm.bootstrap, "--host-maddrs",
         "/ip4/127.0.0.1/tcp/0", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_joiner_with_conflicting_run_config_is_refused(swarm, tmp_path):
    out = _start_once(swarm, "--sync-every", "99", "--checkpoint-dir", str(tmp_path),
                      *swarm.credentials(tmp_path, joining=True))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "atoll: error: run config disagrees with the run's: sync_every=99 (run has 20)"
    )


def test_joiner_without_a_token_is_refused(swarm, tmp_path):
    out = _start_once(swarm, "--checkpoint-dir", str(tmp_path))
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("atoll: error: join_token: run 'atoll' is private (run key ") and "atoll token" in last


def test_joiner_downloads_state_and_contributes(swarm):
    d = swarm.start("d")
    joined = wait_for(lambda: [m for m in d.metrics() if m.get("event") == "joined"], 120, "d to download state")
    assert joined[0]["version"] >= 1
    me = peer_id(d)
    contributed = wait_for(lambda: [r for r in d.rounds() if me in r["contributors"] and len(r["contributors"]) >= 3],
                           180, "d to contribute to a round")
    version = contributed[0]["version"]
    others = wait_for(lambda: [r for r in swarm.daemons["a"].rounds() if r["version"] == version], 60,
                      "a to reach d's round")
    assert others[0]["hash"] == contributed[0]["hash"]
    assert me in others[0]["contributors"]


def test_daemon_killed_mid_round_does_not_stop_the_others(swarm):
    c = swarm.daemons["c"]
    wait_for(lambda: not c.alive(), 240, "c to kill itself in its round")
    assert c.proc.returncode == -9 and "fault injection: killing" in c.log()
    victim = peer_id(c)
    # The round c died in completes without it, within the round timeout plus the retry.
    survived = wait_for(lambda: [r for r in swarm.daemons["a"].rounds()
                                 if victim in r["members"] and victim not in r["contributors"]], 120,
                        "a to finish the round c died in")
    assert survived[0]["seconds"] < 2 * ROUND_TIMEOUT + 10
    after = survived[0]["version"]
    wait_for(lambda: all(any(r["version"] >= after + 3 for r in swarm.daemons[n].rounds()) for n in "abd"), 180,
             "survivors to complete three more rounds")
    assert_replicas_agree(swarm, "abd")


def test_restarted_daemon_resumes_from_checkpoint(swarm):
    b = swarm.daemons["b"]
    assert swarm.stop("b") == 0
    meta = json.loads(sorted(b.workdir.glob("ckpt-*.json"))[-1].read_text())
    b2 = swarm.start("b", join=True)
    line = wait_for(lambda: re.search(r"resumed from checkpoint: version (\d+), step (\d+), data position (\d+)",
                                      b2.log().split("stopped at step")[-1]), 120, "b to resume")
    assert tuple(map(int, line.groups())) == (meta["version"], meta["step"], meta["position"])
    assert peer_id(b2) == meta["peer_id"]  # identity kept in the checkpoint dir: same peer id, same shard
    wait_for(lambda: any(r["version"] > meta["version"] + 1 and peer_id(b2) in r["contributors"]
                         for r in b2.rounds()), 180, "b to contribute again")
    assert_replicas_agree(swarm, "abd")
    codes = swarm.stop_all(timeout=60)
    assert all(codes[n] == 0 for n in "abd"), codes
