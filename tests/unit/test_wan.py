"""Unit tests of the WAN emulator's parts (scripts/wan.py).

The delay line's accounting and the spec parsing are pure and run anywhere. The teardown tests build small WANs
in real network namespaces (root and ``ip netns`` needed: they skip, saying why, only where creating a namespace
fails) and check that nothing with this run's prefix survives a normal exit, an exception, a failed build,
SIGINT/SIGTERM of ``wan.py up``, and — through ``wan.py clean`` — a SIGKILL. Every test that makes namespaces
removes them in a finalizer, even when it fails. No test asserts on wall-clock time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# scripts/ is on sys.path (tests/conftest.py), as when the CLI runs.
from scripts import wan
from scripts.wan import DelayLine, Region, WanError, parse_region, path_params

WAN_PY = str(Path(wan.__file__).resolve())


# ---------------------------------------------------------------------------------------------------------------
# Specs


def test_parse_region_fields():
    r = parse_region("eu,rate=50,delay=25,jitter=2.5,loss=1%,nat")
    assert r == Region("eu", 50.0, 25.0, 2.5, 0.01, True)
    assert parse_region("us") == Region("us")
    assert parse_region("as,loss=0.2").loss == 0.2


@pytest.mark.parametrize("spec", ["EU", "eu,rate=x", "eu,speed=3", "eu,delay=1,jitter=2", "eu,loss=1",
                                  "eu,rate=-1", "averyverylongname", "eu,rate"])
def test_parse_region_rejects(spec):
    with pytest.raises(WanError):
        parse_region(spec)


def test_cli_bad_spec_is_one_line_exit_2(capsys):
    assert wan.main(["up", "--region", "eu,rate=fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wan.py: ") and "rate='fast'" in err


def test_wan_rejects_duplicates_and_empty():
    with pytest.raises(WanError, match="duplicate"):
        wan.Wan([Region("a"), Region("a")])
    with pytest.raises(WanError, match="at least one"):
        wan.Wan([])


# ---------------------------------------------------------------------------------------------------------------
# Delay line accounting


def test_fixed_delay_released_exactly_when_due():
    line = DelayLine(random.Random(0))
    assert line.push("p0", now=10.0, delay_s=0.05) == pytest.approx(10.05)
    assert line.push("p1", now=10.01, delay_s=0.05) == pytest.approx(10.06)
    assert line.pop_due(10.049) == []
    assert line.stats.held == 2 and len(line) == 2
    assert line.pop_due(10.05) == ["p0"]
    assert line.next_due() == pytest.approx(10.06)
    assert line.pop_due(11.0) == ["p1"]
    s = line.stats
    assert (s.pushed, s.released, s.dropped, s.held) == (2, 2, 0, 0)
    assert s.hold_min_s == pytest.approx(0.05)
    assert s.hold_max_s == pytest.approx(0.99)  # p1 waited until the caller looked: hold is measured, not drawn
    assert line.next_due() is None


def test_slack_releases_early_and_accounts_the_real_hold():
    line = DelayLine(random.Random(0))
    line.push("p", now=0.0, delay_s=0.010)
    assert line.pop_due(0.0094, slack=0.0005) == []
    assert line.pop_due(0.0096, slack=0.0005) == ["p"]
    assert line.stats.hold_max_s == pytest.approx(0.0096)


def test_jitter_stays_in_band_and_never_reorders_a_pair():
    rng = random.Random(1)
    line = DelayLine(rng)
    delay, jitter = 0.050, 0.010
    releases: dict = {}
    now = 0.0
    for i in range(2000):
        now += 0.0005  # 2000 packets/s: closer than the jitter band, so reordering would happen if allowed
        key = i % 3
        t = line.push((key, i), now, delay, jitter, key=key)
        # Never before delay - jitter; later than delay + jitter only to wait for the packet ahead of it.
        assert t >= now + delay - jitter - 1e-12
        assert t <= max(now + delay + jitter, max(releases.get(key, [0.0]))) + 1e-12
        releases.setdefault(key, []).append(t)
    for ts in releases.values():
        assert ts == sorted(ts)
    out = []
    while len(line):
        out += line.pop_due(line.next_due())
    for key in range(3):
        seq = [i for k, i in out if k == key]
        assert seq == sorted(seq)
    s = line.stats
    assert s.released == 2000 and s.held == 0 and s.dropped == 0
    assert delay - jitter - 1e-9 <= s.hold_min_s and s.hold_sum_s / s.released >= delay - jitter


def test_loss_and_capacity_drops_are_counted():
    line = DelayLine(random.Random(2))
    n = 20000
    for i in range(n):
        line.push(i, 0.0, 0.01, loss=0.1)
    s = line.stats
    assert s.pushed == n and s.dropped + s.held == n
    assert abs(s.dropped / n - 0.1) < 0.01  # binomial sd 0.002
    small = DelayLine(random.Random(3), capacity=5)
    got = [small.push(i, 0.0, 1.0) for i in range(8)]
    assert got.count(None) == 3 and small.stats.dropped == 3 and small.stats.held == 5


def _ipv4(src: str, dst: str) -> bytes:
    hdr = bytearray(20)
    hdr[0] = 0x45
    hdr[12:16] = bytes(int(x) for x in src.split("."))
    hdr[16:20] = bytes(int(x) for x in dst.split("."))
    return bytes(hdr)


def test_path_params_adds_both_links():
    links = {0: (0.010, 0.001, 0.1), 1: (0.030, 0.002, 0.2), 2: (0.005, 0.0, 0.0)}
    d, j, loss, key = path_params(_ipv4("10.77.0.2", "10.77.1.2"), links)
    assert (d, j, key) == (pytest.approx(0.040), pytest.approx(0.003), (0, 1))
    assert loss == pytest.approx(1 - 0.9 * 0.8)
    # A NAT region's inner address (10.77.100+i) belongs to region i.
    assert path_params(_ipv4("10.77.102.2", "10.77.0.2"), links)[3] == (2, 0)
    assert path_params(b"\x60" + bytes(39), links) == (0.0, 0.0, 0.0, ())  # IPv6: passes undelayed
    assert path_params(_ipv4("192.168.1.1", "10.77.0.2"), links)[0] == pytest.approx(0.010)


# ---------------------------------------------------------------------------------------------------------------
# Teardown, in real namespaces

MINE = f"{wan.PREFIX}{os.getpid()}-"


def _ours(prefix: str) -> list[str]:
    return [n for n in wan.our_namespaces() if n.startswith(prefix)]


@pytest.fixture(scope="module")
def netns_ok():
    """Skip unless a network namespace can be created here (tried, not guessed)."""
    name = f"{MINE}try"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no `ip` command (iproute2)")
    if r.returncode:
        pytest.skip(f"cannot create network namespaces: {r.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@pytest.fixture
def leftovers(netns_ok):
    """Collects pids of `wan.py` runs a test starts; afterwards removes their namespaces and this process's."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for ns in wan.our_namespaces():
        if ns.startswith(MINE) or any(ns.startswith(f"{wan.PREFIX}{p}-") for p in pids):
            wan.remove_namespace(ns)


def test_context_exit_removes_everything_and_kills_processes(leftovers):
    regions = [Region("a", rate_mbit=20, delay_ms=5), Region("b", delay_ms=5, nat=True)]
    with wan.Wan(regions, tag="ctx") as w:
        made = _ours(w.prefix)
        assert sorted(made) == sorted([w.router, w.ns("a"), w.ns("b"), w.gw("b")])
        sleeper = w.popen("a", ["sleep", "600"])
        assert w.run("a", ["ip", "-o", "addr", "show", "eth0"]).stdout.count(w.addr("a")) == 1
    assert _ours(w.prefix) == []
    assert sleeper.poll() is not None
    stats = w.delay_stats()
    assert stats is not None and stats["pushed"] == stats["released"] + stats["dropped"] + stats["held"]
    w.close()  # idempotent


def test_exception_inside_tears_down(leftovers):
    with pytest.raises(RuntimeError):
        with wan.Wan([Region("a")], tag="exc") as w:
            assert _ours(w.prefix)
            raise RuntimeError("boom")
    assert _ours(w.prefix) == []


def test_failed_build_removes_what_it_made(leftovers, monkeypatch):
    def fail(self, gw):
        raise WanError("nat refused")

    monkeypatch.setattr(wan.Wan, "_nat", fail)
    w = wan.Wan([Region("a"), Region("b", nat=True)], tag="fail")
    with pytest.raises(WanError, match="nat refused"):
        w.__enter__()
    assert _ours(w.prefix) == []


def _start_up(state_dir: Path, *regions: str) -> subprocess.Popen:
    args = [a for r in regions for a in ("--region", r)]
    env = {**os.environ, "ATW_STATE_DIR": str(state_dir)}
    p = subprocess.Popen([sys.executable, WAN_PY, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
    for line in p.stdout:
        if line.startswith("state "):
            return p
    raise AssertionError(f"wan.py up did not come up: {p.stderr.read()}")


def test_delay_line_takes_two_signals_at_once(leftovers, capfd):
    """Ctrl-C reaches the delay line and close()'s SIGTERM follows: both can be pending before Python runs either
    handler. Made certain here by sending both while the line is stopped. It must write its stats, exit 0 and
    print nothing (the line inherits our stderr)."""
    with wan.Wan([Region("a", delay_ms=5), Region("b", delay_ms=5)], tag="two") as w:
        line = w._delay
        os.kill(line.pid, signal.SIGSTOP)
        os.kill(line.pid, signal.SIGINT)
        os.kill(line.pid, signal.SIGTERM)
        os.kill(line.pid, signal.SIGCONT)
        assert line.wait(timeout=10) == 0
        assert json.loads(Path(w.stats_path).read_text())["pushed"] >= 0
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("sig,group", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)])
def test_up_tears_down_on_signal(leftovers, tmp_path, sig, group):
    """SIGINT or SIGTERM to `wan.py up`, or SIGINT to its whole process group (Ctrl-C in a terminal: the delay
    line gets it too, then close()'s SIGTERM)."""
    p = _start_up(tmp_path, "a,delay=5", "b,rate=10,nat")
    leftovers.append(p.pid)
    prefix = f"{wan.PREFIX}{p.pid}-"
    assert len(_ours(prefix)) == 4
    env = {**os.environ, "ATW_STATE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, WAN_PY, "exec", "b", "--", "ip", "-o", "addr", "show", "eth0"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0 and "10.77.101.2" in r.stdout
    if group:
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    assert p.wait(timeout=30) in (0, 143), p.stderr.read()
    assert "Traceback" not in p.stderr.read()
    assert _ours(prefix) == []
    assert list(tmp_path.rglob("*.json")) == []


def test_clean_removes_a_killed_run_and_nothing_else(leftovers, tmp_path):
    p = _start_up(tmp_path, "a,delay=5", "b,nat")
    leftovers.append(p.pid)
    prefix = f"{wan.PREFIX}{p.pid}-"
    p.kill()
    p.wait()
    left = _ours(prefix)
    assert len(left) == 4  # SIGKILL leaves everything, the delay line process included
    assert subprocess.run(["ip", "netns", "pids", f"{prefix}r"], capture_output=True, text=True).stdout.strip()
    live = f"{MINE}live"  # a live run's namespace (this test's own pid): clean must leave it
    subprocess.run(["ip", "netns", "add", live], check=True)
    env = {**os.environ, "ATW_STATE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, WAN_PY, "clean"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _ours(prefix) == []
    assert sorted(line.split()[-1] for line in r.stdout.splitlines() if prefix in line) == sorted(left)
    assert live in wan.our_namespaces()
    assert list(tmp_path.rglob("*.json")) == []


def test_exec_without_a_running_wan_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "ATW_STATE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, WAN_PY, "exec", "a", "--", "true"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no running WAN" in r.stderr


def test_nat_region_reaches_out_but_is_unreachable_inbound(leftovers):
    """A NAT region's UDP probe reaches a public region (masqueraded); nothing reaches into it, by either address."""
    with wan.Wan([Region("pub", delay_ms=1), Region("nat", delay_ms=1, nat=True)], tag="nat") as w:
        echo_pub = w.popen("pub", [sys.executable, WAN_PY, "_udp-echo"])
        echo_nat = w.popen("nat", [sys.executable, WAN_PY, "_udp-echo"])
        time.sleep(0.3)
        out = w.run("nat", [sys.executable, WAN_PY, "_udp-rtt", w.addr("pub"), "--count", "3"], timeout=30)
        assert out.returncode == 0 and len(json.loads(out.stdout)) == 3, out.stderr
        gw_wan = w.addr("nat").replace(".101.", ".1.")  # the gateway's outside address, 10.77.1.2
        for host in (w.addr("nat"), gw_wan):
            r = w.run("pub", [sys.executable, WAN_PY, "_udp-rtt", host, "--count", "1"], timeout=30)
            # Unreachable: either no route (the probe fails) or silence (no replies).
            assert r.returncode != 0 or json.loads(r.stdout) == [], (host, r.stdout, r.stderr)
        assert echo_pub.poll() is None and echo_nat.poll() is None
    assert _ours(w.prefix) == []


def test_a_cut_link_drops_everything_both_ways_until_restored(leftovers):
    """While region b's link is cut nothing crosses it, in either direction; after ``restore`` probes are answered
    again, and the regions that were not cut never lost each other."""
    regions = [Region("a", delay_ms=1), Region("b", delay_ms=1), Region("c", delay_ms=1)]
    with wan.Wan(regions, tag="cut") as w:
        for r in "abc":
            w.popen(r, [sys.executable, WAN_PY, "_udp-echo"])
        time.sleep(0.3)

        def answered(src, dst):
            out = w.run(src, [sys.executable, WAN_PY, "_udp-rtt", w.addr(dst), "--count", "3"], timeout=30)
            return out.returncode == 0 and len(json.loads(out.stdout)) > 0

        assert answered("a", "b") and answered("b", "a")
        w.cut("b")
        assert not answered("a", "b") and not answered("b", "a") and not answered("c", "b")
        assert answered("a", "c")
        w.restore("b")
        assert answered("a", "b") and answered("b", "c")
    assert _ours(w.prefix) == []


def test_caps_are_never_exceeded(leftovers):
    """Bounds that hold however loaded the machine is: no round trip beats the configured delay, no stream
    beats the configured rate (the fidelity figures themselves are in docs/wan.md, not asserted)."""
    with wan.Wan([Region("a", rate_mbit=10, delay_ms=10), Region("b", rate_mbit=10, delay_ms=10)], tag="cap") as w:
        m = wan.probe(w, "a", "b", count=5, seconds=1.0)
    assert m["rtt_got"] > 0 and m["rtt_min_ms"] >= w.rtt_ms("a", "b") == 40.0
    assert 0 < m["throughput_mbit"] <= 10.0
    assert _ours(w.prefix) == []
