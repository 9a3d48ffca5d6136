#!/usr/bin/env python3
"""Run a local swarm of atoll daemons on 127.0.0.1, one process each, with live progress and a summary.

    python -m scripts.swarm --daemons 3 --duration 180            # what `make demo` runs

``LocalSwarm`` is also the harness of the integration tests and benchmarks: it starts daemons in their own
process groups (so hivemind's DHT process and p2pd die with them), reads back the multiaddrs they print,
and always ends every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atoll.node.ops.curves import smoothed

from scripts.results import pyplot, save_figure


@dataclass
class DaemonProcess:
    name: str
    proc: subprocess.Popen
    workdir: Path
    maddrs: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def log_path(self) -> Path:
        return self.workdir / "daemon.log"

    def metrics(self) -> list[dict[str, Any]]:
        path = self.workdir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
        return out

    def rounds(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics() if m.get("event") == "round"]

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalSwarm:
    """Starts and ends ``atoll start`` processes under ``root`` (one sub-folder per daemon)."""

    def __init__(self, root: str | os.PathLike, common_args: list[str] | None = None, private: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.common_args = list(common_args or [])
        self.daemons: dict[str, DaemonProcess] = {}
        self.private = private  # as an operator would run it: one run key, a join token for every joiner
        self.run_key = self.root / "run.key"

    def credentials(self, workdir: Path, joining: bool) -> list[str]:
        """The first daemon holds the run key, and keeps it when it restarts (its peer id is the run key's member
        key); each joiner gets its own join token (issued once, kept on restart)."""
        token = workdir / "join.token"
        founder = workdir / "founder"
        if founder.exists() or (not joining and not token.exists()):
            founder.touch()
            return ["--run-key", str(self.run_key)]
        if not token.exists():
            from atoll.protocols.auth import RunKey

            args = self.common_args
            run_id = args[args.index("--run-id") + 1] if "--run-id" in args else "atoll"
            RunKey.load_or_create(self.run_key)[0].issue_token(run_id).save(token)
        return ["--join-token", str(token)]

    @property
    def bootstrap(self) -> list[str]:
        for d in self.daemons.values():
            if d.alive() and d.maddrs:
                return [d.maddrs[0]]
        return []

    def start(self, name: str, extra_args: list[str] | None = None, join: bool = True,
              wait: float = 120.0, program: str | None = None, prefix: list[str] | None = None,
              host: str = "127.0.0.1") -> DaemonProcess:
        """Start a daemon (joining the swarm's first live daemon unless ``join`` is False); wait for its maddrs.
        ``program``: a script run instead of ``atoll start`` (a user's own loop, ``examples/own_loop.py``), given
        ``--checkpoint-dir``, ``extra_args`` and the credentials and initial peers, not the common args.
        ``prefix``: a command that execs the daemon (``ip netns exec NS``: a region of ``scripts/wan.py``), and
        ``host`` the address it listens on there."""
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        if program is None:
            args = [sys.executable, "-m", "atoll.node.cli", "start", "--host-maddrs", f"/ip4/{host}/tcp/0",
                    "--checkpoint-dir", str(workdir), *self.common_args, *(extra_args or [])]
        else:
            args = [sys.executable, program, "--checkpoint-dir", str(workdir), *(extra_args or [])]
        joining = join and self.bootstrap
        if joining:
            args += ["--initial-peers", *self.bootstrap]
        if self.private and "--open" not in args and "--join-token" not in args and "--run-key" not in args:
            args += self.credentials(workdir, bool(joining))
        log = open(workdir / "daemon.log", "ab")
        proc = subprocess.Popen([*(prefix or []), *args], stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        daemon = DaemonProcess(name, proc, workdir)
        self.daemons[name] = daemon

        def read_stdout() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("/"):
                    daemon.maddrs.append(line)
                    daemon.ready.set()
            daemon.ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        if not daemon.ready.wait(wait) or not daemon.maddrs:
            raise RuntimeError(f"daemon {name} did not print its multiaddrs; log:\n{daemon.log()[-3000:]}")
        return daemon

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to a daemon's whole process group (its DHT process and p2pd included), and for SIGKILL to
        the groups of its descendants too (an island's ranks run in sessions of their own, ``--nproc-per-node``)."""
        d = self.daemons[name]
        groups = {d.proc.pid} | (process_groups(d.proc.pid) if sig == signal.SIGKILL else set())
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.daemons[name].proc.wait(30)

    def stop(self, name: str, timeout: float = 60.0) -> int | None:
        """SIGTERM (graceful leave), then SIGKILL the group if it has not exited in ``timeout``."""
        d = self.daemons[name]
        groups = process_groups(d.proc.pid)  # found now: once the daemon exits, its orphans are not its children
        d.proc.send_signal(signal.SIGTERM)  # the daemon alone: its DHT process must live to announce leaving
        try:
            code = d.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.signal(name, signal.SIGKILL)  # leftovers of the group (p2pd) if any
        _kill_groups(groups)
        return code

    def stop_all(self, timeout: float = 60.0) -> dict[str, int | None]:
        groups: set[int] = set()
        for name, d in self.daemons.items():
            if d.alive():
                groups |= process_groups(d.proc.pid)
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for name, d in self.daemons.items():
            try:
                codes[name] = d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
            self.signal(name, signal.SIGKILL)
        _kill_groups(groups)
        return codes

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all(timeout=30)


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, children before their own (from /proc; empty where there is none)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = [int(c) for task in os.listdir(f"/proc/{p}/task")
                        for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        out += children
        todo += children
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_processes(pid: int) -> dict[str, int]:
    """The daemon's own process, its DHT process (a Python child) and p2pd."""
    found = {"daemon": pid}
    for child in descendants(pid):
        try:
            comm = Path(f"/proc/{child}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        if comm == "p2pd":
            found["p2pd"] = child
        elif "dht" not in found and comm.startswith("python"):
            found["dht"] = child
    return found


def process_groups(pid: int) -> set[int]:
    """The process groups of ``pid``'s descendants (from /proc; empty where there is none)."""
    groups = set()
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(child))
    return groups


def _kill_groups(groups: set[int]) -> None:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """Poll ``predicate`` every half second until it returns something truthy (returned); AssertionError after
    ``timeout`` seconds. Tests wait on observable progress (metrics, logs) with it, never on bare sleeps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is left (a daemon's DHT child and p2pd are in it)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def peer_id(d: DaemonProcess) -> str:
    return d.maddrs[0].rsplit("/", 1)[1]


class Dashboard:
    """``atoll dashboard`` on a free port of 127.0.0.1, reading the run through ``initial_peers``; its output goes to
    ``log``. ``url`` is the page's address; ``stop()`` ends it with Ctrl-C's signal and returns its exit code."""

    def __init__(self, initial_peers: list[str], log: Path, interval: float = 2.0, timeout: float = 120.0) -> None:
        self.log = log
        with open(log, "w") as out:  # the child holds its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "atoll.node.cli", "dashboard", "--initial-peers", *initial_peers,
                 "--port", "0", "--interval", str(interval)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        import re

        address = re.compile(r"at (http://127\.0\.0\.1:\d+/)")
        found = wait_for(lambda: address.search(self.text()) or self.proc.poll() is not None, timeout,
                         "the dashboard's address")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited {self.proc.returncode}: {self.text()[-2000:]}")
        self.url: str = found.group(1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def screenshot(self, path: Path, width: int = 1400, height: int = 1360) -> bool:
        """The page as headless Chromium draws it, after its first reads, to ``path`` (PNG); False without
        Chromium."""
        import shutil

        chromium = shutil.which("chromium")
        if chromium is None:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--disable-background-networking", "--no-first-run", f"--window-size={width},{height}",
                        "--virtual-time-budget=5000", f"--screenshot={path.resolve()}", self.url],
                       capture_output=True, timeout=120, check=True)
        return True

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGINT) -> int | None:
        """``sig`` (SIGINT: Ctrl-C; SIGTERM: a service manager's stop; either ends it with exit 0), then SIGKILL
        its group (its DHT process, p2pd) if it lingers."""
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code


class StatusReader:
    """Reads the run's progress records through a client-mode DHT, as ``atoll status`` does."""

    def __init__(self, initial_peers: list[str], run_id: str = "atoll") -> None:
        from atoll.node.config import NodeConfig
        from atoll.node.rounds.join import start_dht
        from atoll.protocols.record_validator import make_validators

        cfg = NodeConfig(run_id=run_id, initial_peers=tuple(initial_peers), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
        self.run_id = run_id
        self.dht = start_dht(cfg, list(make_validators(run_id)), client_mode=True)

    def read(self) -> dict[str, Any]:
        from atoll.node.ops.status import collect_status

        return collect_status(self.dht, self.run_id)

    def close(self) -> None:
        self.dht.shutdown()


def _live_table(doc: dict[str, Any], names: dict[str, str], elapsed: float, duration: float):
    from rich.table import Table

    table = Table(title=f"atoll local swarm — {elapsed:.0f}/{duration:.0f} s — {doc['totals']['peers']} live peers, "
                        f"{doc['totals']['tokens_per_s']:,.0f} tokens/s")
    for col in ("daemon", "status", "step", "tokens/s", "loss", "held-out", "outer rounds", "version", "sent MB"):
        table.add_column(col, justify="left" if col in ("daemon", "status") else "right")
    for p in doc["peers"]:
        table.add_row(names.get(p["peer_id"], p["peer_id"][-8:]), p["status"], str(p["step"]),
                      f"{p['tokens_per_s']:,.0f}", "-" if p["loss"] is None else f"{p['loss']:.3f}",
                      "-" if p["held_out_loss"] is None else f"{p['held_out_loss']:.3f}", str(p["rounds"]),
                      str(p["version"]), f"{p['bytes_sent'] / 1e6:.2f}")
    return table


def plot_loss(swarm: LocalSwarm, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, d) in enumerate(swarm.daemons.items()):
        color = f"C{i}"
        steps = [m for m in d.metrics() if "loss" in m and "event" not in m]
        # Held-out points only where an evaluation ran (a round's record repeats the last figure otherwise).
        evaluated = [r for r in d.rounds()
                     if r.get("held_out_loss") is not None and r.get("held_out_step") == r["step"]]
        if steps:
            tokens, losses = [m["tokens"] for m in steps], [m["loss"] for m in steps]
            ax.plot(tokens, losses, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(tokens, smoothed(losses), color=color, linewidth=1.6, label=f"{name} train (smoothed)")
        if evaluated:
            ax.plot([r["tokens"] for r in evaluated], [r["held_out_loss"] for r in evaluated], "o", color=color,
                    markeredgecolor="black", markersize=5, label=f"{name} held-out")
    ax.set_xlabel("tokens trained by the daemon")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("atoll local swarm: loss against tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)


def summary(swarm: LocalSwarm) -> list[dict[str, Any]]:
    """One row per daemon, from its final ``summary`` event (written as it stops) and its metrics."""
    rows = []
    for name, d in swarm.daemons.items():
        metrics, rounds = d.metrics(), d.rounds()
        steps = [m for m in metrics if "loss" in m and "event" not in m]
        end = next((m for m in reversed(metrics) if m.get("event") == "summary"), {})
        rows.append({
            "daemon": name, "steps": end.get("step", steps[-1]["step"] if steps else 0),
            "tokens": end.get("tokens", steps[-1]["tokens"] if steps else 0),
            "train_loss": steps[-1]["loss"] if steps else None,
            "held_out_loss": end.get("held_out_loss", rounds[-1].get("held_out_loss") if rounds else None),
            "rounds": len(rounds), "version": end.get("version"), "goodput": end.get("goodput"),
            "blocked_s": end.get("blocked_s"), "forks_healed": end.get("forks_healed"),
            "tokens_lost": end.get("tokens_lost"), "tokens_carried": end.get("tokens_carried"),
            "bytes_sent": end.get("bytes_sent"), "dht_calls": end.get("dht_calls") or {},
            "minutes": (end.get("wall_seconds") or 0.0) / 60.0,
        })
    return rows


def control_plane(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, float, float]]:
    """The DHT calls of ``summary``'s rows by record kind, per daemon and minute: (kind, reads, read KiB, writes,
    written KiB), the most bytes first; the records' own bytes, each once (``dht_io.CallStats``)."""
    minutes = sum(r["minutes"] for r in rows)
    if minutes <= 0:
        return []
    totals: dict[str, list[float]] = {}
    for r in rows:
        for name, c in r["dht_calls"].items():
            op, kind = name.split(" ", 1)
            t = totals.setdefault(kind, [0.0, 0.0, 0.0, 0.0])
            at = 0 if op == "get" else 2
            t[at] += c.get("calls", 0)
            t[at + 1] += c.get("bytes", 0) / 1024
    out = [(kind, *(x / minutes for x in t)) for kind, t in totals.items()]
    return sorted(out, key=lambda row: -(row[2] + row[4]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--algorithm", default="decoupled", help="decoupled, streaming, diloco or ddp")
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--plot", default=None, help="PNG path (default: WORKDIR/loss.png)")
    parser.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                        help="do not serve `atoll dashboard` beside the swarm")
    parser.add_argument("--screenshot", default=None, metavar="PNG",
                        help="the dashboard's page, drawn by headless Chromium at the end, to this file")
    args = parser.parse_args()

    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # piped or logged: rich would fold the tables to 80 columns
        console = Console(width=160)
    workdir = Path(args.workdir)
    if workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    common = ["--model", args.model, "--algorithm", args.algorithm, "--sync-every", str(args.sync_every),
              "--gather-timeout", "20", "--round-timeout", "20", "--threads", "1"]
    if args.algorithm == "ddp":
        common += ["--quorum", str(args.daemons)]
    swarm = LocalSwarm(workdir, common)
    reader = dashboard = None
    try:
        console.print(f"starting {args.daemons} daemons ({args.algorithm}, model {args.model}, H={args.sync_every}) "
                      f"in {workdir}/ ...")
        first = swarm.start("daemon-0")
        console.print(f"first daemon listens on {first.maddrs[0]}", soft_wrap=True)
        for i in range(1, args.daemons):
            swarm.start(f"daemon-{i}")
        reader = StatusReader(swarm.bootstrap)
        if args.dashboard:
            dashboard = Dashboard(swarm.bootstrap, workdir / "dashboard.log")
            console.print(f"dashboard: {dashboard.url}")
        names: dict[str, str] = {}
        start = time.monotonic()
        with Live(console=console, refresh_per_second=1) as live:
            while (elapsed := time.monotonic() - start) < args.duration:
                doc = reader.read()
                for d in swarm.daemons.values():
                    for p in doc["peers"]:
                        if d.maddrs and d.maddrs[0].endswith(p["peer_id"]):
                            names[p["peer_id"]] = d.name
                live.update(_live_table(doc, names, elapsed, args.duration))
                time.sleep(2)
        if dashboard is not None and args.screenshot:
            if dashboard.screenshot(Path(args.screenshot)):
                console.print(f"dashboard screenshot: {args.screenshot}")
            else:
                console.print("no chromium here: no screenshot (apt-get install chromium)")
    finally:
        if dashboard is not None:
            dashboard.stop()
        if reader is not None:
            reader.close()
        codes = swarm.stop_all()
    from rich.table import Table

    table = Table(title="summary")
    rows = summary(swarm)
    for col in ("daemon", "exit", "steps", "tokens", "train loss", "held-out", "rounds", "version", "goodput",
                "blocked s", "forks", "tokens lost", "carried", "sent MB"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        fmt = lambda x, spec=".4f": "-" if x is None else format(x, spec)  # noqa: E731
        table.add_row(r["daemon"], str(codes.get(r["daemon"])), str(r["steps"]), f"{r['tokens']:,}",
                      fmt(r["train_loss"]), fmt(r["held_out_loss"]), str(r["rounds"]), str(r["version"]),
                      fmt(r["goodput"], ".2f"), fmt(r["blocked_s"], ".1f"), str(r["forks_healed"]),
                      fmt(r["tokens_lost"], ","), fmt(r["tokens_carried"], ","),
                      fmt(None if r["bytes_sent"] is None else r["bytes_sent"] / 1e6, ".1f"))
    console.print(table)
    control = Table(title="DHT records by kind, per daemon-minute (their own bytes)")
    for col in ("kind", "reads", "read KiB", "writes", "written KiB"):
        control.add_column(col, no_wrap=True, justify="left" if col == "kind" else "right")
    for kind, reads, read_kib, writes, written_kib in control_plane(rows):
        control.add_row(kind, f"{reads:.1f}", f"{read_kib:.1f}", f"{writes:.1f}", f"{written_kib:.1f}")
    console.print(control)
    plot = Path(args.plot) if args.plot else workdir / "loss.png"
    plot_loss(swarm, plot)
    (workdir / "summary.json").write_text(json.dumps(rows, indent=1))
    console.print(f"plot: {plot}   summary: {workdir / 'summary.json'}   logs: {workdir}/daemon-*/daemon.log")
    first = next(iter(swarm.daemons.values())).workdir
    console.print(f"the model: atoll sample {first} --prompt 'def '   (atoll export {first} --out model/: "
                  f"docs/export.md)")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
