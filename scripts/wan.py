#!/usr/bin/env python3
"""A WAN emulator made of Linux network namespaces: regions with capped, delayed, lossy links, some behind NAT.

Topology (one run, every name prefixed ``atw-<pid>-`` so parallel runs and ``clean`` never touch anything else)::

    region ns "eu"  eth0 10.77.0.2/24 ──veth── r0 10.77.0.1/24 ┐
    region ns "us"  eth0 10.77.1.2/24 ──veth── r1 10.77.1.1/24 ├─ router ns ── tun "dl" (the delay line)
    region ns "as"  eth0 10.77.102.2  ──veth── gw ns (nft masquerade) wan 10.77.2.2 ── r2 10.77.2.1 ┘

* Bandwidth: a ``tbf`` qdisc on both ends of each region's access link (the region's egress = its upload, the
  router's egress towards it = its download).
* Delay, jitter and loss: this kernel has no ``netem``, so the router sends every packet that arrives from a
  region (policy rule ``iif rN lookup 77``) into a TUN device; one userspace process (``_delayline``, below) reads
  it, holds each packet for the source region's one-way delay plus the destination region's (± jitter, never
  reordering a src→dst pair), drops it with the regions' loss probability, and writes it back into the TUN, from
  where the main table forwards it to the destination region. RTT between regions a and b is therefore
  ``2 * (delay_a + delay_b)``.
* NAT: a region with ``nat=True`` lives behind its own gateway namespace that masquerades (nftables) and drops
  every connection that does not start inside; the router has no route to the region's inner /24 either.

Only addresses inside the namespaces made here (10.77.0.0/16) and loopback are used; the host's namespace gets
no address, link or route. ``Wan`` is a context manager that tears everything down on exit, on SIGINT/SIGTERM
(the CLI turns them into ``SystemExit``) and after an exception; ``wan.py clean`` removes what a killed run left.

CLI: ``wan.py up --region eu,rate=50,delay=25 --region us,rate=50,delay=25,nat`` (runs until interrupted),
``wan.py exec REGION -- cmd ...``, ``wan.py probe --rtt-ms 100 --rate 50``, ``wan.py fidelity``, ``wan.py clean``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import heapq
import json
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

PREFIX = "atw-"
SUBNET = "10.77"  # regions get 10.77.<i>.0/24; a NAT region's inner LAN is 10.77.<100+i>.0/24
MAX_REGIONS = 100
DELAY_TABLE = 77  # routing table in the router ns that sends region traffic into the delay line
STATE_DIR = Path(os.environ.get("ATW_STATE_DIR", tempfile.gettempdir())) / "atoll-wan"
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class WanError(Exception):
    """A bad spec or a failed set-up step; the CLI prints it on one line and exits 2."""


# ---------------------------------------------------------------------------------------------------------------
# Region specs


@dataclasses.dataclass(frozen=True)
class Region:
    """One region's access link. ``rate_mbit`` caps both directions (0 = uncapped); ``delay_ms`` is one way, per
    direction; ``jitter_ms`` is the half-width of a uniform spread around it; ``loss`` is a drop probability per
    packet and direction; ``nat`` puts the region behind a masquerading gateway with no inbound reachability."""

    name: str
    rate_mbit: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    nat: bool = False

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise WanError(f"region name {self.name!r}: want 1-8 of [a-z0-9], starting with a letter")
        if self.rate_mbit < 0 or self.delay_ms < 0 or self.jitter_ms < 0:
            raise WanError(f"region {self.name}: rate, delay and jitter must be >= 0")
        if self.jitter_ms > self.delay_ms:
            raise WanError(f"region {self.name}: jitter {self.jitter_ms} ms exceeds delay {self.delay_ms} ms")
        if not 0 <= self.loss < 1:
            raise WanError(f"region {self.name}: loss {self.loss} not in [0, 1)")


def parse_region(text: str) -> Region:
    """``NAME[,rate=MBIT][,delay=MS][,jitter=MS][,loss=P|P%][,nat]`` -> Region (WanError on anything else)."""
    name, *fields = text.split(",")
    kw: dict = {}
    keys = {"rate": "rate_mbit", "delay": "delay_ms", "jitter": "jitter_ms", "loss": "loss"}
    for field in fields:
        if field == "nat":
            kw["nat"] = True
            continue
        key, sep, value = field.partition("=")
        if not sep or key not in keys:
            raise WanError(f"region {text!r}: unknown field {field!r} (want rate=, delay=, jitter=, loss=, nat)")
        try:
            kw[keys[key]] = float(value[:-1]) / 100 if value.endswith("%") else float(value)
        except ValueError:
            raise WanError(f"region {text!r}: {key}={value!r} is not a number") from None
    return Region(name, **kw)


# ---------------------------------------------------------------------------------------------------------------
# The delay line's accounting: pure, no sockets (unit-tested on its own)


@dataclasses.dataclass
class LineStats:
    """Counts of a delay line: every packet pushed is either held, released or dropped."""

    pushed: int = 0
    released: int = 0
    dropped: int = 0
    hold_sum_s: float = 0.0
    hold_min_s: float = float("inf")
    hold_max_s: float = 0.0

    @property
    def held(self) -> int:
        return self.pushed - self.released - self.dropped


class DelayLine:
    """Holds packets until their release time. ``push`` draws the hold time: ``delay ± jitter`` (uniform), but never
    earlier than the previous packet with the same ``key`` (a src→dst pair), so jitter delays without reordering —
    as a real path mostly does, and as TCP needs to keep its throughput. ``pop_due(now)`` returns, in release
    order, the packets whose time has come. Time is whatever clock the caller passes (seconds)."""

    def __init__(self, rng: random.Random | None = None, capacity: int = 100_000):
        self.rng = rng or random.Random()
        self.capacity = capacity
        self.stats = LineStats()
        self._heap: list[tuple[float, int, float, object]] = []
        self._seq = 0
        self._last: dict[object, float] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, packet: object, now: float, delay_s: float, jitter_s: float = 0.0, loss: float = 0.0,
             key: object = None) -> float | None:
        """Queue ``packet``; return its release time, or None when it is dropped (loss, or the line is full)."""
        self.stats.pushed += 1
        if (loss and self.rng.random() < loss) or len(self._heap) >= self.capacity:
            self.stats.dropped += 1
            return None
        hold = delay_s + (self.rng.uniform(-jitter_s, jitter_s) if jitter_s else 0.0)
        release = max(now + max(hold, 0.0), self._last.get(key, 0.0))
        self._last[key] = release
        heapq.heappush(self._heap, (release, self._seq, now, packet))
        self._seq += 1
        return release

    def next_due(self) -> float | None:
        """The earliest release time held, or None when empty."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float, slack: float = 0.0) -> list:
        """Remove and return the packets with release time <= now + slack, accounting each one's hold time up to
        ``now`` (the real release). ``slack`` lets a caller whose clock wakes it late on average (poll() rounds
        its timeout up to whole milliseconds) release early by half that, so the mean hold matches the delay."""
        out = []
        s = self.stats
        while self._heap and self._heap[0][0] <= now + slack:
            release, _, pushed_at, packet = heapq.heappop(self._heap)
            hold = now - pushed_at
            s.released += 1
            s.hold_sum_s += hold
            s.hold_min_s = min(s.hold_min_s, hold)
            s.hold_max_s = max(s.hold_max_s, hold)
            out.append(packet)
        return out


def region_of(addr: bytes) -> int | None:
    """The region index of an IPv4 address in 10.77.0.0/16 (a NAT region's inner 10.77.100+i counts as i)."""
    if len(addr) != 4 or addr[0] != 10 or addr[1] != 77:
        return None
    return addr[2] % 100


def path_params(packet: bytes, links: dict[int, tuple[float, float, float]]) -> tuple[float, float, float, tuple]:
    """(delay_s, jitter_s, loss, key) for an IPv4 packet: the source region's link plus the destination's.

    ``links`` maps region index -> (delay_s, jitter_s, loss). Jitters add (their spreads are independent, but a
    sum of uniforms is bounded by the sum of half-widths, which is what the accounting checks); losses combine
    as independent drops. Anything else (not IPv4, unknown region) passes with no delay."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return 0.0, 0.0, 0.0, ()
    src, dst = region_of(packet[12:16]), region_of(packet[16:20])
    a, b = links.get(src, (0.0, 0.0, 0.0)), links.get(dst, (0.0, 0.0, 0.0))
    loss = 1 - (1 - a[2]) * (1 - b[2])
    return a[0] + b[0], a[1] + b[1], loss, (src, dst)


# ---------------------------------------------------------------------------------------------------------------
# The delay line process (runs inside the router namespace)

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device ``name`` in this process's namespace; return a non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run_delayline(tun: str, links: dict[int, tuple[float, float, float]], stats_path: str | None,
                  seed: int | None = None) -> None:
    """Read packets from ``tun``, hold them per ``path_params``, write them back; on SIGTERM write the stats."""
    fd = open_tun(tun)
    line = DelayLine(random.Random(seed))

    class Stop(Exception):
        pass

    stopping = False

    def on_term(*_):
        # Raise once: a second signal (Ctrl-C reaches the whole group, then close() sends SIGTERM) must not
        # interrupt the stats being written. Raise, not set a flag: PEP 475 restarts the blocking poll() after a
        # handler that returns. Not SIG_IGN for the second either: a signal already pending when the handler is
        # swapped raises "Signal N ignored due to race condition" wherever the interpreter then is.
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Stop

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    clock = time.monotonic
    try:
        while True:
            due = line.next_due()
            ready = poll.poll(None if due is None else max(0.0, due - clock()) * 1000)
            if ready:
                now = clock()
                for _ in range(256):  # drain a batch, then release what is due: bounded work per turn
                    try:
                        pkt = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    delay, jitter, loss, key = path_params(pkt, links)
                    line.push(pkt, now, delay, jitter, loss, key)
            for pkt in line.pop_due(clock(), slack=0.0005):  # poll() wakes 0-1 ms late: release 0.5 ms early
                try:
                    os.write(fd, pkt)
                except OSError:  # the kernel refused it (queue full): a drop on the wire
                    line.stats.dropped += 1
                    line.stats.released -= 1
    except Stop:
        pass
    finally:
        if stats_path:
            s = line.stats
            Path(stats_path).write_text(json.dumps({**dataclasses.asdict(s), "held": s.held}))


# ---------------------------------------------------------------------------------------------------------------
# Building and tearing down


def sh(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    """Run a command (inside netns ``ns`` when given); raise WanError with its stderr when ``check`` fails."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise WanError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")
    return r


def tbf(dev: str, ns: str, rate_mbit: float, mtu: int, queue_ms: float) -> None:
    """Cap ``dev``'s egress at ``rate_mbit`` with a token bucket: a 5 ms (>= 2 MTU) burst and a ``queue_ms`` queue.

    Why 5 ms: with 2 ms a 200 Mbit/s link lost ~5-10 % of its rate to timer slack on this (shared) machine; 5 ms
    reached the TCP goodput ceiling (rate * 1448/1514) within ~1 %. tbf counts the Ethernet header, so goodput
    can never exceed that ceiling."""
    rate = rate_mbit * 1e6 / 8  # bytes/s
    burst = max(2 * mtu, int(rate * 0.005))
    limit = max(4 * mtu, int(rate * queue_ms / 1000)) + burst
    sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_mbit * 1e6)}bit",
       "burst", str(burst), "limit", str(limit), "mtu", str(mtu + 100), ns=ns)


def _nft(ns: str, rules: str) -> None:
    """Load an nftables ruleset into namespace ``ns``; ``WanError`` with nft's message if it refuses it."""
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True, text=True)
    if r.returncode:
        raise WanError(f"nft in {ns}: {r.stderr.strip()}")


def our_namespaces() -> list[str]:
    """Names of the network namespaces with our prefix (``atw-<pid>-...``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespace(ns: str) -> None:
    """Kill every process inside ``ns`` (our daemons and delay line), then delete it (its links go with it)."""
    for _ in range(3):
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    sh("ip", "netns", "delete", ns, check=False)


def clean(all_runs: bool = False) -> list[str]:
    """Remove what dead runs left: namespaces ``atw-<pid>-*`` whose pid is gone (every ``atw-`` one with
    ``all_runs``), the processes inside them, and their state and stats files. Returns the namespaces removed; never touches another prefix."""
    removed = []
    for ns in our_namespaces():
        m = re.match(rf"^{PREFIX}(\d+)-", ns)
        if all_runs or not m or not pid_alive(int(m.group(1))):
            remove_namespace(ns)
            removed.append(ns)
    files = [*STATE_DIR.glob(f"{PREFIX}*.json")] if STATE_DIR.is_dir() else []
    files += Path(tempfile.gettempdir()).glob(f"{PREFIX}*-delayline.json")  # a killed run's delay line stats
    for f in files:
        m = re.match(rf"^{PREFIX}(\d+)[-.]", f.name)
        if all_runs or not m or not pid_alive(int(m.group(1))):
            f.unlink(missing_ok=True)
    return removed


class Wan:
    """The emulated WAN as a context manager: ``with Wan([Region("eu", 50, 25), ...]) as wan: wan.popen("eu", cmd)``.

    ``__enter__`` builds everything (and tears down what it built if a step fails); ``__exit__`` kills the
    processes started with ``popen``/``run``, the delay line, and deletes the namespaces. ``addr(region)`` is the
    address daemons in that region listen on (for a NAT region, its inner address, unreachable from outside)."""

    def __init__(self, regions: Sequence[Region], tag: str | None = None, mtu: int = 1500, queue_ms: float = 50.0,
                 seed: int | None = None, tcp_buffer_mb: float | None = None):
        if not regions:
            raise WanError("a WAN needs at least one region")
        if len(regions) > MAX_REGIONS:
            raise WanError(f"at most {MAX_REGIONS} regions")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise WanError(f"duplicate region names in {names}")
        self.regions = list(regions)
        self.index = {r.name: i for i, r in enumerate(regions)}
        self.prefix = f"{PREFIX}{os.getpid()}-{tag + '-' if tag else ''}"
        self.mtu, self.queue_ms, self.seed = mtu, queue_ms, seed
        self.tcp_buffer_mb = tcp_buffer_mb  # None: the kernel's per-namespace defaults (4 MB send, 6 MB receive)
        self.router = self.prefix + "r"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._delay: subprocess.Popen | None = None
        self._stats: dict | None = None
        self.stats_path = str(Path(tempfile.gettempdir()) / f"{self.prefix}delayline.json")
        self.state_path: Path | None = None

    # names and addresses
    def ns(self, region: str) -> str:
        """The namespace daemons of ``region`` run in."""
        return self.prefix + self._region(region).name

    def gw(self, region: str) -> str:
        return self.prefix + self._region(region).name + "-gw"

    def addr(self, region: str) -> str:
        i = self.index[self._region(region).name]
        return f"{SUBNET}.{100 + i if self.regions[i].nat else i}.2"

    def _region(self, name: str) -> Region:
        if name not in self.index:
            raise WanError(f"no region {name!r} (have {', '.join(self.index)})")
        return self.regions[self.index[name]]

    def rtt_ms(self, a: str, b: str) -> float:
        """The configured round trip between regions a and b (ms)."""
        return 2 * (self._region(a).delay_ms + self._region(b).delay_ms)

    # building
    def _netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._made.append(name)
        sh("ip", "link", "set", "lo", "up", ns=name)
        # No IPv6: no router solicitations or DAD in the probes' way; everything here is IPv4.
        sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1", ns=name)

    def _veth(self, ns_a: str, dev_a: str, addr_a: str, ns_b: str, dev_b: str, addr_b: str) -> None:
        """A veth pair made directly inside the two namespaces (the host never holds either end)."""
        sh("ip", "link", "add", dev_a, "netns", ns_a, "mtu", str(self.mtu), "type", "veth",
           "peer", "name", dev_b, "netns", ns_b, "mtu", str(self.mtu))
        for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
            sh("ip", "addr", "add", addr + "/24", "dev", dev, ns=ns)
            sh("ip", "link", "set", dev, "up", ns=ns)

    def __enter__(self) -> "Wan":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        r = self.router
        self._netns(r)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
           "net.ipv4.conf.default.rp_filter=0", ns=r)
        # The delay line's TUN: persistent, so routes can point at it before the process attaches.
        sh("ip", "tuntap", "add", "dev", "dl", "mode", "tun", ns=r)
        sh("ip", "link", "set", "dl", "mtu", str(self.mtu), "txqueuelen", "10000", "up", ns=r)
        sh("ip", "route", "add", f"{SUBNET}.0.0/16", "dev", "dl", "table", str(DELAY_TABLE), ns=r)
        for i, reg in enumerate(self.regions):
            ns, rdev = self.ns(reg.name), f"r{i}"
            self._netns(ns)
            if reg.nat:
                gw = self.gw(reg.name)
                self._netns(gw)
                self._veth(gw, "wan", f"{SUBNET}.{i}.2", r, rdev, f"{SUBNET}.{i}.1")
                self._veth(ns, "eth0", f"{SUBNET}.{100 + i}.2", gw, "lan", f"{SUBNET}.{100 + i}.1")
                sh("ip", "route", "add", "default", "via", f"{SUBNET}.{100 + i}.1", ns=ns)
                sh("ip", "route", "add", "default", "via", f"{SUBNET}.{i}.1", ns=gw)
                sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=gw)
                self._nat(gw)
                up_ns, up_dev = gw, "wan"
            else:
                self._veth(ns, "eth0", f"{SUBNET}.{i}.2", r, rdev, f"{SUBNET}.{i}.1")
                sh("ip", "route", "add", "default", "via", f"{SUBNET}.{i}.1", ns=ns)
                up_ns, up_dev = ns, "eth0"
            sh("sysctl", "-qw", f"net.ipv4.conf.{rdev}.rp_filter=0", ns=r)
            if self.tcp_buffer_mb:
                # A long fat path (200 ms x 200 Mbit/s = 5 MB in flight) outgrows the default windows.
                top = int(self.tcp_buffer_mb * 2**20)
                sh("sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {top}", f"net.ipv4.tcp_wmem=4096 16384 {top}",
                   ns=ns)
            # Traffic from this region goes through the delay line; what the line writes back arrives on "dl"
            # and is forwarded by the main table (connected routes to each rN).
            sh("ip", "rule", "add", "iif", rdev, "lookup", str(DELAY_TABLE), ns=r)
            if reg.rate_mbit:
                tbf(up_dev, up_ns, reg.rate_mbit, self.mtu, self.queue_ms)  # upload
                tbf(rdev, r, reg.rate_mbit, self.mtu, self.queue_ms)  # download
        links = {i: (g.delay_ms / 1000, g.jitter_ms / 1000, g.loss) for i, g in enumerate(self.regions)}
        cmd = ["ip", "netns", "exec", r, sys.executable, os.path.abspath(__file__), "_delayline", "--tun", "dl",
               "--links", json.dumps(links), "--stats", self.stats_path]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        self._delay = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self._wait_attached()

    def _wait_attached(self, timeout: float = 10.0) -> None:
        """Wait for the delay line to attach to its TUN (the device's carrier comes up when a process holds it)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._delay.poll() is not None:
                raise WanError(f"delay line exited with {self._delay.returncode}")
            out = sh("ip", "-o", "link", "show", "dl", ns=self.router).stdout
            if "NO-CARRIER" not in out:
                return
            time.sleep(0.05)
        raise WanError("delay line did not attach to its TUN")

    def _nat(self, gw: str) -> None:
        """Masquerade the region's LAN behind the gateway's wan address; drop every connection started outside."""
        rules = """
table ip atw_nat {
  chain nat_post { type nat hook postrouting priority srcnat; oifname "wan" masquerade; }
  chain lan_forward { type filter hook forward priority filter; policy drop;
    ct state established,related accept; iifname "lan" oifname "wan" accept; }
  chain wan_input { type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept; iifname "wan" drop; }
}
"""
        _nft(gw, rules)

    # partitions
    def cut(self, region: str) -> None:
        """Cut ``region``'s link: the router drops every packet to or from it, both ways, as a failed link does
        (nothing is refused: connections stall, and resume if they outlive the cut). ``restore`` ends it."""
        i = self.regions.index(self._region(region))
        rules = f"""
table ip atw_cut{i} {{
  chain forward {{ type filter hook forward priority filter; policy accept;
    iifname "r{i}" drop; oifname "r{i}" drop; }}
}}
"""
        _nft(self.router, rules)

    def restore(self, region: str) -> None:
        """End ``cut(region)``: its link forwards again."""
        i = self.regions.index(self._region(region))
        sh("nft", "delete", "table", "ip", f"atw_cut{i}", ns=self.router)

    # running things inside
    def popen(self, region: str, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` inside ``region``'s namespace; it is killed at teardown if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(region), *cmd], **kw)
        self._procs.append(p)
        return p

    def run(self, region: str, cmd: Sequence[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``region`` to completion (capturing its output as text)."""
        return subprocess.run(["ip", "netns", "exec", self.ns(region), *cmd], capture_output=True, text=True,
                              timeout=timeout, **kw)

    def delay_stats(self) -> dict | None:
        """The delay line's counts (pushed, released, dropped, held, hold times), after ``close``; else None."""
        return self._stats

    def write_state(self) -> Path:
        """Record names and addresses for ``wan.py exec`` in another shell."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.state_path = STATE_DIR / f"{PREFIX}{os.getpid()}.json"
        self.state_path.write_text(json.dumps({
            "pid": os.getpid(), "router": self.router,
            "regions": {r.name: {"ns": self.ns(r.name), "addr": self.addr(r.name), **dataclasses.asdict(r)}
                        for r in self.regions}}))
        return self.state_path

    def close(self) -> None:
        """Tear down, idempotent: our processes (TERM, then KILL), the delay line, then every namespace made."""
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        if self._delay is not None:
            if self._delay.poll() is None:
                self._delay.terminate()
                try:
                    self._delay.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    self._delay.kill()
                    self._delay.wait()
            self._delay = None
            try:
                self._stats = json.loads(Path(self.stats_path).read_text())
            except (OSError, ValueError):
                pass
            Path(self.stats_path).unlink(missing_ok=True)
        for ns in reversed(self._made):
            remove_namespace(ns)
        self._made.clear()
        if self.state_path:
            self.state_path.unlink(missing_ok=True)
            self.state_path = None


# ---------------------------------------------------------------------------------------------------------------
# Probes: a UDP echo for RTT and a TCP stream for throughput, run inside the namespaces

PROBE_PORT = 7777


def udp_echo(port: int = PROBE_PORT) -> None:
    """Echo every UDP datagram back to its sender (until killed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(data, peer)


def udp_rtt(host: str, count: int = 20, interval: float = 0.05, port: int = PROBE_PORT,
            timeout: float = 2.0) -> list[float]:
    """Round trips (ms) of ``count`` numbered datagrams sent every ``interval`` s to ``udp_echo``, matched by number
    (so a late or reordered reply still counts); waits ``timeout`` after the last send. Lost ones are left out,
    so ``count - len(result)`` is the round-trip loss."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    sent: dict[int, float] = {}
    out: list[float] = []
    seq = 0
    next_send = time.perf_counter()
    deadline = None
    while True:
        now = time.perf_counter()
        if seq < count and now >= next_send:
            sent[seq] = now
            try:
                s.sendto(struct.pack("!I", seq), (host, port))
            except OSError:  # no route, refused: lost
                pass
            seq += 1
            next_send += interval
            if seq == count:
                deadline = now + timeout
        if deadline is not None and (now >= deadline or len(out) == count):
            break
        wait = (next_send if seq < count else deadline) - now
        if select.select([s], [], [], max(0.0, wait))[0]:
            try:
                data, _ = s.recvfrom(2048)
            except OSError:  # an ICMP error reported on the socket
                continue
            t = sent.pop(struct.unpack("!I", data[:4])[0], None)
            if t is not None:
                out.append((time.perf_counter() - t) * 1000)
    return out


def tcp_sink(port: int = PROBE_PORT, warmup: float = 1.0) -> None:
    """Accept TCP connections and discard what they send. When the sender shuts down, reply with the receive rate
    (Mbit/s, 8-byte double) counted from ``warmup`` seconds after the first byte to the last: measured where the
    bytes arrive, so data still queued in the sender's buffer never counts."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen()
    while True:
        c, _ = srv.accept()
        first = mark = None
        n = 0
        last = time.perf_counter()
        while chunk := c.recv(1 << 20):
            last = time.perf_counter()
            if first is None:
                first = last
            elif mark is None and last - first >= warmup:
                mark = last
                n = 0
            n += len(chunk)
        rate = n * 8 / (last - mark) / 1e6 if mark is not None and last > mark else -1.0
        c.sendall(struct.pack("!d", rate))
        c.close()


def tcp_throughput(host: str, seconds: float = 5.0, warmup: float = 1.0, port: int = PROBE_PORT) -> float:
    """Mbit/s of one TCP stream to ``tcp_sink`` sending for ``warmup + seconds``, as the sink counted it (after
    ``warmup`` seconds of slow start)."""
    c = socket.create_connection((host, port), timeout=30)
    buf = b"\0" * (1 << 16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup + seconds:
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR)
    data = b""
    while len(data) < 8 and (chunk := c.recv(8 - len(data))):
        data += chunk
    c.close()
    rate = struct.unpack("!d", data)[0]
    if rate < 0:
        raise WanError("throughput probe ended before its warm-up")
    return rate


def probe(wan: Wan, a: str, b: str, count: int = 20, seconds: float = 5.0, interval: float = 0.05) -> dict:
    """Measure RTT (UDP echo) and throughput a -> b (one TCP stream) inside ``wan``; b must be reachable."""
    me = [sys.executable, os.path.abspath(__file__)]
    host = wan.addr(b)
    echo = wan.popen(b, [*me, "_udp-echo"])
    sink = wan.popen(b, [*me, "_tcp-sink"])
    try:
        time.sleep(0.3)
        r = wan.run(a, [*me, "_udp-rtt", host, "--count", str(count), "--interval", str(interval)],
                    timeout=count * interval + 30)
        if r.returncode:
            raise WanError(f"rtt probe: {r.stderr.strip()}")
        rtts = json.loads(r.stdout)
        r = wan.run(a, [*me, "_tcp-stream", host, "--seconds", str(seconds)], timeout=seconds + 60)
        if r.returncode:
            raise WanError(f"throughput probe: {r.stderr.strip()}")
        mbit = json.loads(r.stdout)
    finally:
        for p in (echo, sink):
            p.kill()
            p.wait()
    rtts.sort()
    q = lambda f: rtts[min(len(rtts) - 1, int(f * len(rtts)))] if rtts else None  # noqa: E731
    return {"rtt_configured_ms": wan.rtt_ms(a, b), "rtt_sent": count, "rtt_got": len(rtts),
            "rtt_loss": 1 - len(rtts) / count, "rtt_p05_ms": q(0.05), "rtt_p95_ms": q(0.95),
            "rtt_min_ms": rtts[0] if rtts else None, "rtt_median_ms": rtts[len(rtts) // 2] if rtts else None,
            "rtt_max_ms": rtts[-1] if rtts else None, "throughput_mbit": mbit}


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _regions_arg(values: Iterable[str]) -> list[Region]:
    return [parse_region(v) for v in values]


def _live_state(wan_id: int | None) -> dict:
    files = sorted(STATE_DIR.glob(f"{PREFIX}*.json")) if STATE_DIR.is_dir() else []
    states = [json.loads(f.read_text()) for f in files]
    states = [s for s in states if pid_alive(s["pid"]) and (wan_id is None or s["pid"] == wan_id)]
    if not states:
        raise WanError("no running WAN (start one with `wan.py up`)")
    if len(states) > 1:
        raise WanError(f"several WANs running ({', '.join(str(s['pid']) for s in states)}): pick one with --id")
    return states[0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wan.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{up,exec,probe,fidelity,clean}")
    up = sub.add_parser("up", help="build the WAN and hold it until SIGINT/SIGTERM")
    up.add_argument("--region", action="append", required=True, metavar="SPEC",
                    help="NAME[,rate=MBIT][,delay=MS][,jitter=MS][,loss=P|P%%][,nat]; repeat per region")
    up.add_argument("--mtu", type=int, default=1500)
    up.add_argument("--tcp-buffer-mb", type=float, help="raise the regions' TCP buffer limits to this (default: kernel's)")
    ex = sub.add_parser("exec", help="run a command inside a region of the running WAN")
    ex.add_argument("region")
    ex.add_argument("--id", type=int, help="pid of the `up` process when several run")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- cmd ...")
    pr = sub.add_parser("probe", help="build two regions and measure RTT and throughput between them")
    pr.add_argument("--rtt-ms", type=float, default=0.0, help="configured round trip (split over both links)")
    pr.add_argument("--jitter-ms", type=float, default=0.0, help="per-link jitter")
    pr.add_argument("--rate", type=float, default=0.0, help="Mbit/s cap on both links (0 = none)")
    pr.add_argument("--loss", type=float, default=0.0)
    pr.add_argument("--seconds", type=float, default=5.0)
    pr.add_argument("--count", type=int, default=20, help="UDP echoes for the RTT (and loss)")
    pr.add_argument("--interval", type=float, default=0.05, help="seconds between echoes")
    pr.add_argument("--mtu", type=int, default=1500)
    pr.add_argument("--tcp-buffer-mb", type=float, help="raise the regions' TCP buffer limits to this")
    fi = sub.add_parser("fidelity", help="probe across the benchmarks' range; print a markdown table")
    fi.add_argument("--seconds", type=float, default=5.0)
    fi.add_argument("--mtu", type=int, default=1500)
    cl = sub.add_parser("clean", help="remove what killed runs left (namespaces atw-<dead pid>-*)")
    cl.add_argument("--all", action="store_true", help="also those of runs still alive")
    hidden = {"_delayline", "_udp-echo", "_udp-rtt", "_tcp-sink", "_tcp-stream"}
    dl = sub.add_parser("_delayline")
    dl.add_argument("--tun", required=True)
    dl.add_argument("--links", required=True)
    dl.add_argument("--stats")
    dl.add_argument("--seed", type=int)
    sub.add_parser("_udp-echo")
    sub.add_parser("_tcp-sink")
    ur = sub.add_parser("_udp-rtt")
    ur.add_argument("host")
    ur.add_argument("--count", type=int, default=20)
    ur.add_argument("--interval", type=float, default=0.05)
    ts = sub.add_parser("_tcp-stream")
    ts.add_argument("host")
    ts.add_argument("--seconds", type=float, default=5.0)
    sub._choices_actions = [a for a in sub._choices_actions if a.dest not in hidden]  # keep --help short

    args = ap.parse_args(argv)
    try:
        return _dispatch(args)
    except WanError as e:
        print(f"wan.py: {e}", file=sys.stderr)
        return 2


def _sigterm_exits() -> None:
    """SIGTERM and SIGINT leave through SystemExit/KeyboardInterrupt, so ``with Wan`` tears down."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _dispatch(args) -> int:
    if args.cmd == "_delayline":
        links = {int(k): tuple(v) for k, v in json.loads(args.links).items()}
        run_delayline(args.tun, links, args.stats, args.seed)
        return 0
    if args.cmd == "_udp-echo":
        udp_echo()
    if args.cmd == "_tcp-sink":
        tcp_sink()
    if args.cmd == "_udp-rtt":
        print(json.dumps(udp_rtt(args.host, args.count, args.interval)))
        return 0
    if args.cmd == "_tcp-stream":
        print(json.dumps(tcp_throughput(args.host, args.seconds)))
        return 0
    if args.cmd == "clean":
        for ns in clean(args.all):
            print(f"removed {ns}")
        return 0
    if args.cmd == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise WanError("exec: no command (wan.py exec REGION -- cmd ...)")
        st = _live_state(args.id)
        if args.region not in st["regions"]:
            raise WanError(f"no region {args.region!r} (have {', '.join(st['regions'])})")
        return subprocess.call(["ip", "netns", "exec", st["regions"][args.region]["ns"], *argv])
    regions = _regions_arg(args.region) if args.cmd == "up" else []  # bad specs fail before anything is built
    _sigterm_exits()
    if args.cmd == "up":
        with Wan(regions, mtu=args.mtu, tcp_buffer_mb=args.tcp_buffer_mb) as wan:
            path = wan.write_state()
            for r in regions:
                print(f"{r.name}: ns {wan.ns(r.name)} addr {wan.addr(r.name)}{' (NAT)' if r.nat else ''}", flush=True)
            print(f"state {path}; Ctrl-C tears down", flush=True)
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:
                pass
        return 0
    if args.cmd == "probe":
        half = args.rtt_ms / 4
        regions = [Region(n, args.rate, half, args.jitter_ms, args.loss) for n in ("a", "b")]
        with Wan(regions, mtu=args.mtu, tcp_buffer_mb=args.tcp_buffer_mb) as wan:
            m = probe(wan, "a", "b", args.count, args.seconds, args.interval)
        s = wan.delay_stats() or {}
        if s.get("released"):  # the delay line's own account: what it held, against what was asked
            m["line"] = {k: s[k] for k in ("pushed", "released", "dropped", "held")}
            m["line"]["hold_mean_ms"] = s["hold_sum_s"] / s["released"] * 1000
            m["line"]["hold_configured_ms"] = args.rtt_ms / 2
        print(json.dumps(m))
        return 0
    if args.cmd == "fidelity":
        print("| configured RTT ms | rate Mbit/s | RTT min / median / max ms | throughput Mbit/s |")
        print("|---|---|---|---|")
        for rtt in (0, 50, 100, 200):
            for rate in (10, 50, 200):
                regions = [Region(n, rate, rtt / 4) for n in ("a", "b")]
                with Wan(regions, mtu=args.mtu) as wan:
                    m = probe(wan, "a", "b", 20, args.seconds)
                print(f"| {rtt} | {rate} | {m['rtt_min_ms']:.2f} / {m['rtt_median_ms']:.2f} / "
                      f"{m['rtt_max_ms']:.2f} | {m['throughput_mbit']:.1f} |", flush=True)
        return 0
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
