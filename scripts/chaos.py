#!/usr/bin/env python3
"""Chaos run: a local swarm under a seeded schedule of faults, against a fault-free twin of the same length.

    python -m scripts.chaos --algorithm decoupled [--seeds 0 1 2] [--daemons 6] [--duration 420] [--faults-per-kind 11]

Faults: ``--faults-per-kind`` of each of five kinds (55 by default), in a seeded random order at uniformly random
times between 10% and 80% of the window. ``kill`` (SIGKILL of the daemon's process group, restarted after a
``--rejoin`` delay from its checkpoint directory), ``freeze`` (SIGSTOP of the group for ``--freeze`` seconds, then
SIGCONT), ``leave`` (SIGTERM: a graceful leave, rejoining after a ``--rejoin`` delay from its checkpoint), ``join``
(a brand-new daemon that stays ``--visit`` seconds, then leaves for good) and ``checkpoint_kill`` (SIGUSR1 arms
the daemon's ``checkpoint_kill_signal`` fault: it dies in the middle of its next checkpoint write and is
restarted). A fault that would leave fewer than ``--min-live`` daemons training waits until it would not
(``deferred_s`` in its log entry); one still waiting at the window's end is logged as ``not_injected``.

The fault-free twin gets the schedule's joins, at the same times and for the same visits, and nothing else: both
swarms have the same daemons to count. The twins run side by side, in the same window (``--sequential``: one after
the other), so that the load of this shared machine weighs on both alike. Every daemon sleeps ``--step-delay``
seconds per inner step, so that it is less bound by the CPU: otherwise a killed daemon would hand its CPU to the
others and the fault would look free. ``machine_cpu_busy`` in the results says how loaded each window was.

Reported per seed (``<out>/<name>_s<seed>.json``; ``<name>`` is ``chaos_<algorithm>`` unless ``--name``) and over
the seeds (``<out>/<name>_summary.json``: mean, 95% interval, seeds meeting each goal); plot ``<out>/chaos.png``
over every run there. All computed from the daemons' metrics.jsonl and checkpoints:
faults injected by kind; goodput: tokens that reached the global model (trained in the window, less those thrown
away by crashes, i.e. trained after a daemon's last checkpoint, and by adoptions, their ``lost_tokens``), chaos
over fault-free twin; the same for tokens trained; the pace of the live daemons (tokens per daemon-second of a
training process, chaos / twin: whether the faults slowed down the daemons they did not hit); the longest interval
in which no round completed on any daemon, against the twin's own longest one; held-out loss of the survivors'
final checkpoints relative to the twin's (side by side, both swarms are stopped at the same moment, once the chaos
swarm's restarting daemons are back and its survivors hold identical replicas) and, noisier, as of each
survivor's last round before the window's end; forks healed; and whether the survivors ended identical (a moment
before the end when all held the same version and hash of every fragment) and on one history (their final
checkpoints agree at each fragment's oldest final version).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from scripts.bars import bar, each
from scripts.benchkit import evaluate_swarm
from scripts.results import pyplot, save_figure, write_result
from scripts.swarm import LocalSwarm

from atoll.node.home.checkpoint import load_checkpoint
from atoll.node.config import RunConfig

KINDS = ("kill", "freeze", "leave", "join", "checkpoint_kill")


def daemon_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--algorithm", args.algorithm, "--sync-every", str(args.sync_every),
            "--batch-size", str(args.batch_size), "--gather-timeout", "10", "--round-timeout", "10",
            "--heartbeat", "1", "--threads", "1", "--harness", f"step_delay={args.step_delay}",
            "--fault", "checkpoint_kill_signal=1", "--eval-budget", "1",  # the window-end loss needs every round's
            *args.daemon_args.split()]


def schedule(rng: random.Random, duration: float, per_kind: int) -> list[tuple[float, str]]:
    """Fault times (seconds after the start of the window) and kinds: ``per_kind`` of each of the five kinds, in a
    random order, at uniformly random times between 10% and 80% of the window (the last 20% lets restarts finish)."""
    kinds = [k for k in KINDS for _ in range(per_kind)]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.1 * duration, 0.8 * duration) for _ in kinds)
    return list(zip(times, kinds))


def reference_schedule(faults: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """What the fault-free twin gets of a schedule: its joins, at the same times (a join adds a daemon for a
    visit; both swarms get the same visitors, so that neither has more daemons to count)."""
    return [(t, kind) for t, kind in faults if kind == "join"]


class Chaos:
    """Runs a schedule against a LocalSwarm. Restarts happen on background threads (starting takes seconds)."""

    def __init__(self, swarm: LocalSwarm, args: argparse.Namespace, rng: random.Random) -> None:
        self.swarm, self.args, self.rng = swarm, args, rng
        self.state: dict[str, str] = {}  # name -> live | frozen | down | starting | retired (a visit ended)
        self.expect_death: set[str] = set()  # checkpoint_kill armed: the death is the fault, restart it
        self.log: list[dict] = []
        self.joined = 0
        self.spawned: list[tuple[str, float]] = []  # (name, wall time) of every start after the first ones
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def start(self, name: str, delay: float = 0.0) -> None:
        if self.state.get(name) == "retired":  # a visitor whose visit ended stays away
            return
        self.state[name] = "starting"

        def run() -> None:
            time.sleep(delay)
            if self.state.get(name) == "retired":  # its visit ended while it was down
                return
            # Several bootstrap peers, drawn at random, the original daemons first (a visitor may leave any time):
            # any one may be frozen or killed meanwhile.
            live = [n for n in self.live() if n not in self.expect_death]
            originals = [n for n in live if n.startswith("d")]
            chosen = self.rng.sample(originals, min(3, len(originals)))
            chosen += self.rng.sample([n for n in live if n not in chosen], min(3 - len(chosen), len(live) - len(chosen)))
            peers = [self.swarm.daemons[n].maddrs[0] for n in chosen if self.swarm.daemons[n].maddrs]
            try:
                extra = ["--initial-peers", *peers] if peers else []
                self.spawned.append((name, time.time()))
                self.swarm.start(name, daemon_args(self.args) + extra, join=not peers)
                if self.state.get(name) == "retired":
                    self.swarm.stop(name, timeout=60)
                else:
                    self.state[name] = "live"
            except RuntimeError as e:
                # Its bootstrap peers went down while it started (or the machine is too loaded): try again, as an
                # operator's supervisor would. Counted: each is downtime the fault caused.
                self.record(time.monotonic() - self.t0, "start_failed", name, error=str(e).splitlines()[0])
                self.swarm.signal(name, signal.SIGKILL)
                if self.state.get(name) != "retired":
                    self.state[name] = "down"
                    self.start(name, delay=self.rng.uniform(*self.args.rejoin))

        threading.Thread(target=run, daemon=True).start()

    def live(self) -> list[str]:
        return sorted(n for n, s in self.state.items() if s == "live")

    def record(self, t: float, kind: str, target: str, **extra) -> None:
        entry = {"t": round(t, 2), "kind": kind, "target": target, **extra}
        self.log.append(entry)
        print(f"  t={t:6.1f}s {kind:16s} {target} {extra or ''}", flush=True)

    def inject(self, t: float, kind: str) -> bool:
        """Injects one fault now; False (nothing done) if it would leave fewer than ``min_live`` daemons training:
        the caller retries it later."""
        live = [n for n in self.live() if n not in self.expect_death]  # an armed checkpoint kill is as good as down
        removes = kind in ("kill", "leave", "freeze", "checkpoint_kill")
        if removes and len(live) <= self.args.min_live:
            return False
        if kind == "join":
            name = f"j{self.joined}"
            self.joined += 1
            self.start(name)
            threading.Timer(self.args.visit, self.retire, args=(name,)).start()
            self.record(t, kind, name, visit_s=self.args.visit)
            return True
        target = self.rng.choice(live)
        rejoin = self.rng.uniform(*self.args.rejoin)
        if kind == "kill":
            self.swarm.kill(target)
            self.state[target] = "down"
            self.start(target, delay=rejoin)
            self.record(t, kind, target, restart_after_s=round(rejoin, 1))
        elif kind == "leave":
            self.state[target] = "down"

            def leave_and_return() -> None:
                code = self.swarm.stop(target, timeout=60)
                self.record(time.monotonic() - self.t0, "left", target, exit_code=code)
                self.start(target, delay=rejoin)

            threading.Thread(target=leave_and_return, daemon=True).start()
            self.record(t, kind, target, rejoin_after_s=round(rejoin, 1))
        elif kind == "freeze":
            self.swarm.signal(target, signal.SIGSTOP)
            self.state[target] = "frozen"

            def thaw() -> None:
                time.sleep(self.args.freeze)
                self.swarm.signal(target, signal.SIGCONT)
                if self.state.get(target) == "frozen":
                    self.state[target] = "live"

            threading.Thread(target=thaw, daemon=True).start()
            self.record(t, kind, target, seconds=self.args.freeze)
        elif kind == "checkpoint_kill":
            os.kill(self.swarm.daemons[target].proc.pid, signal.SIGUSR1)  # the daemon alone: it arms the fault
            self.expect_death.add(target)
            self.record(t, kind, target)
        return True

    def retire(self, name: str) -> None:
        """A visitor's visit is over: it leaves for good (gracefully, if it is running), in both swarms alike."""
        previous, self.state[name] = self.state.get(name), "retired"
        self.record(time.monotonic() - self.t0, "visit_ended", name, was=previous)
        d = self.swarm.daemons.get(name)
        if d is not None and d.alive():
            self.swarm.signal(name, signal.SIGCONT)  # a frozen visitor must run to leave
            self.swarm.stop(name, timeout=60)

    def reap(self, t: float) -> None:
        """Restart daemons that died in a checkpoint write (or unexpectedly: counted)."""
        for name, s in list(self.state.items()):
            d = self.swarm.daemons.get(name)
            if s == "live" and d is not None and not d.alive():
                expected = name in self.expect_death
                self.expect_death.discard(name)
                self.swarm.signal(name, signal.SIGKILL)  # the rest of its group
                self.state[name] = "down"
                self.record(t, "died_in_checkpoint" if expected else "unexpected_exit", name,
                            code=d.proc.returncode)
                self.start(name, delay=self.rng.uniform(*self.args.rejoin))

    def run(self, faults: list[tuple[float, str]], duration: float, t0: float, label: str = "window") -> None:
        """Injects each fault at its time, or as soon after as enough daemons are live (deferred, not dropped);
        faults still pending when the window ends are recorded as ``not_injected``."""
        self.t0 = t0
        pending = list(faults)
        with bar(label, duration, unit="s") as progress:
            while time.monotonic() - t0 < duration:
                self._tick(time.monotonic() - t0, pending)
                progress.update(time.monotonic() - t0)
                time.sleep(0.2)
        for when, kind in pending:
            self.record(time.monotonic() - t0, "not_injected_" + kind, "-", due=round(when, 1))

    def _tick(self, t: float, pending: list[tuple[float, str]]) -> None:
        """One look at the schedule at ``t``: at most one due fault injected (removed from ``pending``); exits
        reaped."""
        for due in [f for f in pending if f[0] <= t]:
            if self.inject(t, due[1]):
                pending.remove(due)
                if t - due[0] > 0.5:
                    self.log[-1]["deferred_s"] = round(t - due[0], 1)
                break  # one per tick: deferred faults do not all land on the same moment (and target)
        self.reap(t)


def cpu_times() -> tuple[int, int]:
    """The machine's (total, idle) CPU time so far, in clock ticks (Linux /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    total, idle = after[0] - before[0], after[1] - before[1]
    return 1.0 - idle / total if total else float("nan")


def start_seconds(daemons, spawned: list[tuple[str, float]]) -> list[float]:
    """Seconds from each (re)start of a daemon process to its first training step."""
    out = []
    for name, t in spawned:
        steps = [m["time"] for m in step_lines(daemons[name]) if m["time"] >= t]
        if steps:
            out.append(round(min(steps) - t, 1))
    return out


def step_lines(d) -> list[dict]:
    return [m for m in d.metrics() if "step" in m and "event" not in m]


def tokens_in_window(daemons, t0: float, t1: float) -> int:
    """Tokens trained inside [t0, t1]: the sum of increases between consecutive step records of each daemon
    (a restart resets the counter to its checkpoint's value: that drop is not counted as training)."""
    total = 0
    for d in daemons:
        prev = None
        for m in step_lines(d):
            if t0 <= m["time"] <= t1 and prev is not None and m["tokens"] > prev["tokens"] and prev["time"] >= t0:
                total += m["tokens"] - prev["tokens"]
            prev = m
    return total


def live_seconds(daemons, t0: float, t1: float) -> float:
    """Daemon-seconds inside [t0, t1] that a daemon process was up and training: per process lifetime (a restart
    or a join starts a new one), from its first to its last step record."""
    total = 0.0
    for d in daemons:
        lifetimes, current = [], []
        for m in d.metrics():
            if m.get("event") in ("resumed", "joined") and current:
                lifetimes.append(current)
                current = []
            elif "step" in m and "event" not in m and t0 <= m["time"] <= t1:
                current.append(m["time"])
        lifetimes.append(current)
        total += sum(max(times) - min(times) for times in lifetimes if times)
    return total


def round_times(daemons, t0: float, t1: float) -> list[float]:
    return sorted(m["time"] for d in daemons for m in d.rounds() if t0 <= m["time"] <= t1)


def longest_gap(times: list[float], t0: float, t1: float) -> float:
    edges = [t0, *times, t1]
    return max(b - a for a, b in zip(edges, edges[1:]))


def round_period(daemons) -> float:
    """Median interval between two rounds of the same fragment on the same daemon."""
    gaps = []
    for d in daemons:
        by_fragment: dict[int, list[float]] = {}
        for r in d.rounds():
            by_fragment.setdefault(r["fragment"], []).append(r["time"])
        for times in by_fragment.values():
            gaps += [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def kept_tokens(trained: int, lost_to_crashes: int, lost_to_adoptions: int) -> int:
    """Tokens of the window that reached the global model, as far as the daemons' own accounting tells: those
    trained, less those a crash threw away (trained after the last checkpoint) and those an adoption overwrote."""
    return trained - lost_to_crashes - lost_to_adoptions


def downtime(chaos_gap: float, reference_gap: float) -> dict:
    """The chaos swarm's longest interval with no round completed anywhere, judged against the fault-free twin's
    own longest one (not against a round period: with staggered fragments rounds come far more often)."""
    return {"longest_gap_s": chaos_gap, "reference_longest_gap_s": reference_gap,
            "longest_gap_ratio": chaos_gap / reference_gap,
            "downtime_beyond_fault_free_s": max(0.0, chaos_gap - reference_gap)}


def crash_losses(d) -> int:
    """Tokens a daemon trained after its last checkpoint before each death (killed or died in a checkpoint)."""
    lost, last_ckpt, last_tokens = 0, None, None
    for m in d.metrics():
        if m.get("event") == "checkpoint":
            last_ckpt = m["tokens"]
        elif m.get("event") in ("resumed", "joined"):
            if last_tokens is not None and last_ckpt is not None and m.get("event") == "resumed":
                lost += max(0, last_tokens - last_ckpt)
            last_tokens = None
        elif "step" in m and "event" not in m:
            last_tokens = m["tokens"]
    return lost


def window_end_loss(daemons, t1: float) -> list[float]:
    """Each daemon's held-out loss as of the end of the window: the one its last round before ``t1`` measured
    (after merging fragment 0; the same held-out batches on every daemon). Noisier than the final checkpoints: the
    daemons measure at different moments, each right after one fragment merged."""
    out = []
    for d in daemons:
        losses = [r["held_out_loss"] for r in d.rounds() if r["time"] <= t1 and r.get("held_out_loss") is not None]
        if losses:
            out.append(losses[-1])
    return out


def replica_now(d) -> dict:
    out = {}
    for m in d.metrics():
        if m.get("event") in ("round", "adopted"):
            out[m["fragment"]] = (m["version"], m["hash"])
    return out


def wait_identical(daemons, timeout: float) -> float | None:
    """Seconds until every daemon held the same version and hash of every fragment, or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if len({json.dumps(replica_now(d), sort_keys=True) for d in daemons}) == 1:
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def one_history(daemons, fragments: int) -> bool:
    finals = []
    for d in daemons:
        loaded = load_checkpoint(d.workdir)
        if loaded is None:
            return False
        finals.append((loaded[1]["versions"], loaded[1]["ancestors"]))
    for p in range(fragments):
        common = min(v[p] for v, _ in finals)
        seen = set()
        for v, anc in finals:
            back = v[p] - common
            seen.add(anc[p][-1 - back] if back < len(anc[p]) else None)
        if len(seen) != 1 or None in seen:
            return False
    return True


def run_once(root: Path, args: argparse.Namespace, chaos: bool, barrier: threading.Barrier | None = None) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(args.seed)
    faults = schedule(rng, args.duration, args.faults_per_kind)
    if not chaos:
        faults = reference_schedule(faults)
    with LocalSwarm(root, []) as swarm:
        c = Chaos(swarm, args, rng)
        swarm.start("d0", daemon_args(args), join=False)
        c.state["d0"] = "live"
        for i in range(1, args.daemons):
            c.start(f"d{i}")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
                len(c.live()) == args.daemons and all(step_lines(swarm.daemons[n]) for n in c.live())):
            time.sleep(0.5)
        if barrier is not None:
            barrier.wait()  # both swarms are training: their windows start together
        t0_mono, t0 = time.monotonic(), time.time()
        c.spawned.clear()  # the swarm's first starts are not restarts
        cpu0 = cpu_times()
        print(f"  {'chaos' if chaos else 'fault-free'}: {len(faults)} events scheduled; window starts", flush=True)
        c.run(faults, args.duration, t0_mono, "chaos window" if chaos else "fault-free window")
        t1 = time.time()
        cpu_busy = busy_share(cpu0, cpu_times())
        # Survivors: live now, plus those frozen or restarting, which are let finish first.
        settle = time.monotonic() + 120  # the window is over; no more faults
        while time.monotonic() < settle and any(s in ("starting", "frozen") for s in c.state.values()):
            time.sleep(0.5)
        survivors = [swarm.daemons[n] for n in c.live()]
        identical_after = wait_identical(survivors, args.settle)
        if barrier is not None:
            # Both swarms stop at the same moment, so their final checkpoints have trained equally long: the
            # fault-free one keeps training while the chaos one waits for its restarting daemons.
            barrier.wait()
        stopped = time.time()
        codes = swarm.stop_all(timeout=90)
    daemons = list(swarm.daemons.values())
    run = RunConfig(model=args.model, algorithm=args.algorithm, sync_every=args.sync_every)
    losses = evaluate_swarm(SimpleNamespace(daemons={d.name: d for d in survivors}), run)
    times = round_times(daemons, t0, t1)
    adopted = [{**m, "daemon": d.name} for d in daemons for m in d.metrics()
               if m.get("event") == "adopted" and t0 <= m["time"] <= t1]
    kinds: dict[str, int] = {}
    for f in c.log:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    tokens = tokens_in_window(daemons, t0, t1)
    lost_to_adoptions = sum(m["lost_tokens"] for m in adopted)
    lost_to_crashes = sum(crash_losses(d) for d in daemons)
    return {
        "faults": c.log, "faults_by_kind": {k: kinds.get(k, 0) for k in KINDS},
        "faults_deferred": sum(1 for f in c.log if "deferred_s" in f),
        "other_events": {k: n for k, n in kinds.items() if k not in KINDS}, "window_s": t1 - t0,
        "tokens": tokens, "rounds": len(times),
        "tokens_kept": kept_tokens(tokens, lost_to_crashes, lost_to_adoptions),
        "live_daemon_seconds": live_seconds(daemons, t0, t1),
        "longest_gap_s": longest_gap(times, t0, t1), "round_period_s": round_period(daemons),
        "held_out_loss_window_end": statistics.mean(window_end_loss(survivors, t1)),
        "held_out_loss_final_checkpoints": statistics.mean(losses), "held_out_loss_per_survivor": losses,
        "settle_s": stopped - t1,
        # How loaded the machine was (both swarms, side by side): a saturated CPU slows restarts and lets a fault's
        # freed CPU speed up the others, neither of which separate machines would see.
        "machine_cpu_busy": cpu_busy, "start_to_first_step_s": start_seconds(swarm.daemons, c.spawned),
        "survivors": [d.name for d in survivors], "exit_codes": codes,
        "forks_healed": sum(1 for m in adopted if m.get("forked")),
        "tokens_lost_to_adoptions": lost_to_adoptions, "tokens_lost_to_crashes": lost_to_crashes,
        # What the adoptions lost, by cause: our side of a fork, or unmerged work past the carry bound.
        "tokens_lost_to_forks": sum(m["lost_tokens"] for m in adopted if m.get("forked")),
        "adoptions": [{"t": round(m["time"] - t0, 2), "daemon": m["daemon"], "fragment": m.get("fragment"),
                       "forked": bool(m.get("forked")), "lost_tokens": m["lost_tokens"],
                       "replayed": m.get("replayed", 0)} for m in sorted(adopted, key=lambda m: m["time"])],
        "identical_after_s": identical_after, "survivors_identical": identical_after is not None,
        "survivors_on_one_history": one_history(survivors, run.num_fragments),
        "timeline": {"rounds": times, "t0": t0,
                     "tokens": sorted((m["time"], m["tokens"], d.name) for d in daemons for m in step_lines(d))},
    }


def plot(out: Path) -> None:
    plt = pyplot()

    docs = [json.loads(p.read_text()) for p in sorted(out.glob("chaos_*.json"))]
    docs = [d for d in docs if "reference" in d]  # per-run files, not the summaries
    if not docs:
        return
    colors = dict(zip(KINDS, ("tab:red", "tab:blue", "tab:orange", "tab:green", "tab:purple")))
    fig, axes = plt.subplots(len(docs), 1, figsize=(10, 3.4 * len(docs)), squeeze=False)
    for ax, doc in zip(axes[:, 0], docs):
        for label, r, style in (("fault-free twin", doc["reference"], "--"), ("chaos", doc["chaos"], "-")):
            t0 = r["timeline"]["t0"]
            times = [t - t0 for t in r["timeline"]["rounds"]]
            ax.plot(times, range(1, len(times) + 1), style, color="black" if label == "chaos" else "gray",
                    label=f"{label}: rounds completed (all daemons)")
        for f in doc["chaos"]["faults"]:
            if f["kind"] in colors:
                ax.axvline(f["t"], color=colors[f["kind"]], alpha=0.5, lw=0.8)
        for kind, color in colors.items():
            ax.plot([], [], color=color, label=f"{kind} ({doc['chaos']['faults_by_kind'].get(kind, 0)})")
        m = doc["metrics"]
        ax.set_title(f"{doc['name']}: {m['faults_injected']} faults; goodput {m['goodput']:.3f}; longest gap "
                     f"{m['longest_gap_s']:.1f} s vs {m['reference_longest_gap_s']:.1f} s fault-free; held-out "
                     f"{m['loss_ratio_final_checkpoints']:.3f}x; identical {m['survivors_identical']}", fontsize=9)
        ax.set_xlabel("seconds into the window")
        ax.set_ylabel("rounds completed")
        ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    save_figure(fig, out / "chaos.png")


def run_seed(args: argparse.Namespace, name: str, out: Path) -> dict:
    """One seed: the chaos swarm and its fault-free twin; writes ``<out>/<name>.json``."""
    root = Path("runs/chaos") / name.removeprefix("chaos_")
    if args.sequential:
        print(f"{name}: fault-free twin, {args.daemons} daemons, {args.duration:.0f} s", flush=True)
        reference = run_once(root / "reference", args, chaos=False)
        print(f"{name}: chaos swarm", flush=True)
        chaos = run_once(root / "chaos", args, chaos=True)
    else:
        # Side by side in the same window: the machine's load (shared CPU) weighs on both alike.
        print(f"{name}: a fault-free twin and a chaos swarm ({5 * args.faults_per_kind} faults, seed {args.seed}) "
              f"side by side, {args.daemons} daemons each, {args.duration:.0f} s", flush=True)
        barrier = threading.Barrier(2, timeout=600)
        with ThreadPoolExecutor(2) as pool:
            ref_future = pool.submit(run_once, root / "reference", args, False, barrier)
            chaos_future = pool.submit(run_once, root / "chaos", args, True, barrier)
            reference, chaos = ref_future.result(), chaos_future.result()
    metrics = {
        # Both swarms had the same visitors; only tokens that reached the global model count.
        "goodput": chaos["tokens_kept"] / reference["tokens_kept"],
        "goodput_trained": chaos["tokens"] / reference["tokens"],
        "faults_injected": sum(chaos["faults_by_kind"].values()),
        "faults_by_kind": chaos["faults_by_kind"],
        "stopped_together": not args.sequential,
        "pace_of_live_daemons": (chaos["tokens"] / chaos["live_daemon_seconds"])
        / (reference["tokens"] / reference["live_daemon_seconds"]),
        "loss_ratio": chaos["held_out_loss_window_end"] / reference["held_out_loss_window_end"],
        "loss_ratio_final_checkpoints": chaos["held_out_loss_final_checkpoints"]
        / reference["held_out_loss_final_checkpoints"],
        **downtime(chaos["longest_gap_s"], reference["longest_gap_s"]),
        "round_period_s": reference["round_period_s"],
        "forks_healed": chaos["forks_healed"],
        "tokens_lost": chaos["tokens_lost_to_adoptions"] + chaos["tokens_lost_to_crashes"],
        "tokens_lost_share": (chaos["tokens_lost_to_adoptions"] + chaos["tokens_lost_to_crashes"]) / chaos["tokens"],
        "reference_tokens_lost_share": (reference["tokens_lost_to_adoptions"] + reference["tokens_lost_to_crashes"])
        / reference["tokens"],
        "survivors_identical": chaos["survivors_identical"],
        "survivors_on_one_history": chaos["survivors_on_one_history"],
        "machine_cpu_busy": {"reference": reference["machine_cpu_busy"], "chaos": chaos["machine_cpu_busy"]},
        "start_to_first_step_s": chaos["start_to_first_step_s"],
    }
    doc = {"algorithm": args.algorithm, "name": name, "seed": args.seed,
           "args": vars(args), "metrics": metrics,
           "reference": reference, "chaos": chaos}
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / f"{name}.json", doc)
    print(json.dumps({"name": name, **{k: v for k, v in metrics.items() if k != "start_to_first_step_s"}}, indent=1),
          flush=True)
    return doc


def summarize(docs: list[dict]) -> dict:
    """Mean and 95% interval over seeds of each headline figure, and in how many seeds each goal held."""
    from scripts.stats import interval

    keys = ("goodput", "goodput_trained", "loss_ratio_final_checkpoints", "longest_gap_s",
            "reference_longest_gap_s", "longest_gap_ratio", "downtime_beyond_fault_free_s", "tokens_lost_share",
            "faults_injected", "pace_of_live_daemons")
    return {
        "seeds": [d["seed"] for d in docs], "runs": [d["name"] for d in docs],
        **{k: interval([d["metrics"][k] for d in docs]) for k in keys},
        "faults_by_kind_min": {k: min(d["metrics"]["faults_by_kind"][k] for d in docs) for k in KINDS},
        "seeds_goodput_at_least_0.95": sum(d["metrics"]["goodput"] >= 0.95 for d in docs),
        "seeds_no_downtime_beyond_fault_free": sum(d["metrics"]["downtime_beyond_fault_free_s"] == 0 for d in docs),
        "seeds_survivors_identical": sum(bool(d["metrics"]["survivors_identical"]) for d in docs),
        "seeds_on_one_history": sum(bool(d["metrics"]["survivors_on_one_history"]) for d in docs),
    }


def rejoin_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    try:
        pair = (float(low), float(high))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH seconds, got {text!r}") from None
    if not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH, got {text!r}")
    return pair


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="decoupled", choices=("decoupled", "diloco", "streaming"))
    parser.add_argument("--daemons", type=int, default=6)
    parser.add_argument("--duration", type=float, default=420.0, help="seconds of the measured window")
    parser.add_argument("--faults-per-kind", type=int, default=11,
                        help="faults of each of the five kinds per run (55 in all by default)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed, then a summary")
    parser.add_argument("--freeze", type=float, default=10.0, help="seconds a frozen daemon stays stopped")
    parser.add_argument("--rejoin", type=rejoin_range, default=(2.0, 8.0),
                        help="LOW,HIGH: a killed or departed daemon restarts after a uniform delay in this range")
    parser.add_argument("--visit", type=float, default=40.0, help="seconds a joiner stays (in both swarms)")
    parser.add_argument("--min-live", type=int, default=2,
                        help="a fault that would leave fewer daemons training waits until it would not")
    parser.add_argument("--model", default="nano")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--daemon-args", default="", help="extra flags for every daemon of both swarms")
    parser.add_argument("--settle", type=float, default=60.0,
                        help="seconds to wait at the end for the survivors to hold identical replicas")
    parser.add_argument("--sequential", action="store_true",
                        help="run the fault-free swarm first, then the chaos swarm (default: both at once)")
    parser.add_argument("--name", help="results name (default chaos_<algorithm>): <out>/<name>_s<seed>.json, "
                                       "<out>/<name>_summary.json, runs/chaos/<name>_s<seed>")
    parser.add_argument("--out", default="docs/results/chaos")
    parser.add_argument("--replot", action="store_true", help="only redraw chaos.png from the JSON files")
    args = parser.parse_args()
    out = Path(args.out)
    name = args.name or f"chaos_{args.algorithm}"
    if not name.startswith("chaos_"):
        parser.error("--name must start with chaos_ (the plot collects <out>/chaos_*.json)")
    if args.replot:
        plot(out)
        return 0
    docs = []
    for seed in each(args.seeds, "seeds"):
        args.seed = seed
        docs.append(run_seed(args, f"{name}_s{seed}", out))
    summary = {**summarize(docs)}
    write_result(out / f"{name}_summary.json", summary)
    plot(out)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
