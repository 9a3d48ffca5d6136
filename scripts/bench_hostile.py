#!/usr/bin/env python3
"""A hostile member against a live decoupled swarm, side by side with the same swarm without it.

    python -m scripts.bench_hostile --attack copied_claim [--seeds 0 1 2] [--steps 1200] [--label L] [--out DIR]
    python -m scripts.bench_hostile --attack byzantine=edge [--robust-merge RULE] ...
    python -m scripts.bench_hostile --attack reducer=scale ...
    python -m scripts.bench_hostile --attack none ...       # the noise floor: two clean runs a seed

Per seed, two runs of three honest daemons in a private run (`decoupled`, nano, batch 4, H=50 and the default
round settings, every daemon sleeping ``--step-delay`` s a step, started together): a clean one, and one where a member
holding a join token (``scripts/hostile/member.py``, a process of its own) runs ``--attack`` from the first merged
round until the honest daemons stop; or, for ``--attack byzantine=K`` or ``reducer=K``, a fourth daemon with a
join token that trains and merges with that ``--fault`` (``node/faults.py``) from that round on; with ``--control
honest`` the clean run has the same fourth daemon without the fault (a like-for-like count of processes on a
machine whose cores the daemons share, and of members per round). ``--attackers 2``: two of either, each with a
token of its own (colluders). ``--attack none``: the "attacked" run is a second clean one (what two runs of a seed
differ by with no attack: the floor under which a difference is noise). The order of the two alternates from seed
to seed. Each daemon's data shard is pinned by seed and name (``--harness data_shard``), as in ``bench_mixed``, so
that the two runs of a seed train on the same data (a fresh identity would pick another shard); ``--no-pin-data``
lets each identity pick its own, as the runs recorded before that option did. Measured from the honest daemons'
own metrics: the held-out loss of their final replicas (mean over a, b, c), multi-member merges a minute per daemon,
adoptions (and any whose donors include the member, or whose replica is one the member served), and their refusals
by kind (with their DHT nodes' refusals, from their logs); and each honest daemon's peak resident memory and open
file descriptors (its process tree: the daemon, its DHT process, p2pd; sampled every 2 s). Goals (the hostile-
internet issue): held-out within 5% of the clean run, merges a minute at least 80% of it. ``--label`` names the code
under test (run from another checkout for a before/after); results accumulate in ``<out>/bench_hostile.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.results import write_result
from scripts.stats import interval
from scripts.swarm import LocalSwarm, descendants, peer_id, wait_for

ROOT = Path(__file__).resolve().parent.parent

HONEST = ("a", "b", "c")
ATTACKERS = ("m", "n")


def common(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--model", "nano", "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", str(args.sync_every),
            "--max-steps", str(args.steps), "--harness", f"step_delay={args.step_delay}",
            "--harness", f"start_together={len(HONEST)}", "--seed", str(seed), "--eval-budget", "1",
            *(["--robust-merge", args.robust_merge] if args.robust_merge else [])]


SAMPLE_EVERY = 2.0  # seconds between samples of the honest daemons' resident memory and file descriptors


def tree_resources(pid: int) -> tuple[float, int]:
    """Resident MiB and open file descriptors of ``pid`` and its descendants (its DHT process, p2pd)."""
    rss, fds = 0.0, 0
    for p in [pid, *descendants(pid)]:
        try:
            rss += next(int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                        if line.startswith("VmRSS:")) / 1024
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return rss, fds


class Peaks:
    """Samples the honest daemons' process trees every ``SAMPLE_EVERY`` s while it runs (a context manager):
    ``rss_mib`` and ``fds`` are each daemon's peaks."""

    def __init__(self, swarm: LocalSwarm) -> None:
        self.swarm, self.rss_mib, self.fds = swarm, {n: 0.0 for n in HONEST}, {n: 0 for n in HONEST}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            for name in HONEST:
                d = self.swarm.daemons.get(name)
                if d is not None and d.alive():
                    rss, fds = tree_resources(d.proc.pid)
                    self.rss_mib[name], self.fds[name] = max(self.rss_mib[name], rss), max(self.fds[name], fds)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def daemon_attack(args: argparse.Namespace) -> bool:
    return args.attack.startswith(("byzantine=", "reducer="))


def pinned(args: argparse.Namespace, seed: int, name: str) -> list[str]:
    """The daemon ``name``'s data shard for ``seed`` (none with ``--no-pin-data``)."""
    names = (*HONEST, *ATTACKERS)
    return ["--harness", f"data_shard={seed * len(names) + names.index(name)}"] if args.pin_data else []


def run(root: Path, args: argparse.Namespace, seed: int, attack: bool) -> dict:
    from atoll.protocols.auth import RunKey

    attack = attack and args.attack != "none"
    with LocalSwarm(root, common(args, seed)) as swarm:
        swarm.start("a", pinned(args, seed, "a"), join=False)
        for name in HONEST[1:]:
            swarm.start(name, pinned(args, seed, name))
        a = swarm.daemons["a"]
        wait_for(lambda: any(len(r["contributors"]) > 1 for r in a.rounds()), 300, "a's first merged round")
        members, results = [], [root / f"member{i}.json" for i in range(args.attackers)]
        if daemon_attack(args) and (attack or args.control == "honest"):
            for name in ATTACKERS[: args.attackers]:  # daemons of the run, lying in every round they merge
                swarm.start(name, [*pinned(args, seed, name), *(["--fault", args.attack] if attack else [])])
        elif attack:
            for i, result in enumerate(results):  # members.py processes of their own, one token each
                token = root / f"member{i}.token"
                RunKey.load_or_create(swarm.run_key)[0].issue_token("atoll").save(token)
                cmd = [sys.executable, "-m", "scripts.hostile.member", "--initial-peers", *swarm.bootstrap,
                       "--token", str(token), "--out", str(result), "--algorithm", "decoupled",
                       "--sync-every", str(args.sync_every), f"{args.attack}={args.attack_seconds}"]
                with open(root / f"member{i}.log", "wb") as log:
                    members.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                    cwd=ROOT, preexec_fn=lambda: os.nice(args.attacker_nice)))
        try:
            with Peaks(swarm) as peaks:
                codes = {n: d.proc.wait(args.run_timeout) for n, d in swarm.daemons.items()}
        finally:
            for member in members:
                if member.poll() is None:
                    os.killpg(member.pid, signal.SIGTERM)
                    try:
                        member.wait(30)
                    except subprocess.TimeoutExpired:
                        os.killpg(member.pid, signal.SIGKILL)
        got = [json.loads(r.read_text()) for r in results if r.exists()]
        return {**measure(swarm, codes, got, attack), "peak_rss_mib": peaks.rss_mib, "peak_fds": peaks.fds}


def measure(swarm: LocalSwarm, codes: dict, members: list[dict], attack: bool) -> dict:
    served = {d for member in members
              for d in [*member.get("zero_digests", []), *member.get("scrambled_digests", []),
                        *(d for phase in member.values() if isinstance(phase, dict) for d in phase.get("digests", []))]}
    who = {member["member"] for member in members if member.get("member")}
    out: dict = {"attack": attack, "exit_codes": codes,
                 "member": [{k: v for k, v in member.items() if k != "done"} for member in members]}
    if len(members) == 1:
        out["member"] = out["member"][0]  # as the runs before --attackers recorded it
    losses, rates, adoptions, from_member, poisoned, kinds = [], [], 0, 0, 0, {}
    for name in HONEST:
        d = swarm.daemons[name]
        metrics = d.metrics()
        rounds = [m for m in metrics if m.get("event") == "round"]
        evaluated = [r["held_out_loss"] for r in rounds if r.get("held_out_loss") is not None]
        if not evaluated:
            raise RuntimeError(f"{name} (exit code {codes.get(name)}) recorded {len(rounds)} rounds, none with a "
                               f"held-out loss")
        losses.append(evaluated[-1])
        merged = [r for r in rounds if len(r["contributors"]) > 1]
        minutes = (rounds[-1]["time"] - rounds[0]["time"]) / 60  # from the first round to the last
        rates.append(len(merged) / minutes)
        adopted = [m for m in metrics if m.get("event") == "adopted"]
        adoptions += len(adopted)
        from_member += sum(1 for m in adopted if who & set(m.get("donors", [])))
        poisoned += sum(1 for m in [*adopted, *rounds] if m.get("hash") in served)
        summary = next((m for m in metrics if m.get("event") == "summary"), {})
        for kind, count in summary.get("rejected_by_kind", {}).items():
            kinds[kind] = kinds.get(kind, 0) + count
        # Its DHT process's refusals (protocols/dht_guard.py) are in its log only: the last count it logged.
        logged = re.findall(r"DHT node refused a call of \S+ \(\S+\); refused so far: (\{[^}]*\})", d.log())
        for kind, count in (ast.literal_eval(logged[-1]).items() if logged else ()):
            kinds["dht:" + kind] = kinds.get("dht:" + kind, 0) + count
    out.update(held_out=statistics.mean(losses), held_out_per_daemon=losses, merges_per_min=statistics.mean(rates),
               adoptions=adoptions, adoptions_from_member=from_member, member_replicas_held=poisoned,
               rejected_by_kind=kinds, peer_ids={n: peer_id(swarm.daemons[n]) for n in HONEST})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", required=True, help="a member.py attack, e.g. copied_claim, or byzantine=K or "
                                                   "reducer=K; none: two clean runs (the noise floor)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--attack-seconds", type=float, default=600.0, help="at most; the member stops with the swarm")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--robust-merge", default=None, help="the run's --robust-merge (default: the daemon's)")
    p.add_argument("--attackers", type=int, default=1, choices=(1, 2),
                   help="attackers, each with a token of its own: member.py processes, or daemons running a "
                        "byzantine= or reducer= fault (2: two colluding tokens)")
    p.add_argument("--control", choices=("alone", "honest"), default="alone",
                   help="the clean run: the honest daemons alone, or (daemon attacks) with the attacking daemons "
                        "running honestly")
    p.add_argument("--attacker-nice", type=int, default=0,
                   help="member.py attacks: the member's niceness (19: it runs on cycles the honest daemons leave, "
                        "as an attacker with a machine of its own would, on a machine whose cores they share)")
    p.add_argument("--no-pin-data", dest="pin_data", action="store_false",
                   help="let each daemon's identity pick its data shard (the runs before pinning)")
    p.add_argument("--keep", default=None, help="keep each run's daemons' folders (logs, metrics) under this folder")
    p.add_argument("--only", choices=("clean", "attacked"), default=None, help="run one side of each pair only")
    p.add_argument("--label", default="default")
    p.add_argument("--out", default="docs/results/hostile")
    args = p.parse_args()
    if args.control == "honest" and not daemon_attack(args):
        p.error("--control honest needs a daemon attack (byzantine=K or reducer=K)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_hostile.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
    for seed in args.seeds:
        order = (False, True) if seed % 2 == 0 else (True, False)
        if args.only:
            order = tuple(o for o in order if o == (args.only == "attacked"))
        pair = {}
        for attack in order:
            with tempfile.TemporaryDirectory(prefix="atoll-hostile-") as tmp:
                root = Path(args.keep) / f"{args.label}-seed{seed}-{'attacked' if attack else 'clean'}" \
                    if args.keep else Path(tmp)
                root.mkdir(parents=True, exist_ok=True)
                started = time.monotonic()
                try:
                    r = run(root, args, seed, attack)
                except Exception:
                    if not args.keep:  # the daemons' folders say why: keep them
                        kept = Path(tempfile.mkdtemp(prefix=f"atoll-hostile-failed-seed{seed}-"))
                        shutil.copytree(root, kept, dirs_exist_ok=True)
                        print(f"{args.label} seed {seed}: the run failed; its daemons' folders are in {kept}",
                              flush=True)
                    raise
            name = args.attack if args.attackers == 1 else f"{args.attack} x{args.attackers}"
            r.update(attack=attack, seed=seed, label=args.label, attack_name=name, control=args.control,
                     attacker_nice=args.attacker_nice, pinned_data=args.pin_data,
                     wall_s=time.monotonic() - started,
                     command="python -m scripts.bench_hostile " + " ".join(sys.argv[1:]))
            pair[attack] = r
            doc["runs"].append(r)
            print(f"{args.label} seed {seed} {'attacked' if attack else 'clean   '}: held-out {r['held_out']:.3f}, "
                  f"merges/min {r['merges_per_min']:.1f}, adoptions {r['adoptions']} (from the member "
                  f"{r['adoptions_from_member']}), member's replicas held {r['member_replicas_held']}, peak RSS "
                  f"{max(r['peak_rss_mib'].values()):.0f} MiB, peak fds {max(r['peak_fds'].values())}, refused "
                  f"{ {k: v for k, v in r['rejected_by_kind'].items() if v} }", flush=True)
        if len(pair) == 2:
            print(f"  held-out ratio {pair[True]['held_out'] / pair[False]['held_out']:.3f}, merges ratio "
                  f"{pair[True]['merges_per_min'] / pair[False]['merges_per_min']:.2f}", flush=True)
        write_result(path, summarize(doc))
    return 0


def summarize(doc: dict) -> dict:
    """Per label and attack: the attacked run over the clean one of the same seed, with 95% intervals."""
    groups: dict = {}
    for r in doc["runs"]:
        groups.setdefault((r["label"], r["attack_name"]), {}).setdefault(r["seed"], {})[r["attack"]] = r
    doc["summary"] = []
    for (label, attack), seeds in sorted(groups.items()):
        pairs = [s for s in seeds.values() if True in s and False in s]
        if not pairs:
            continue
        held = [s[True]["held_out"] / s[False]["held_out"] for s in pairs]
        merges = [s[True]["merges_per_min"] / s[False]["merges_per_min"] for s in pairs]
        doc["summary"].append({"label": label, "attack": attack, "seeds": len(pairs),
                               "control": pairs[0][False].get("control", "alone"),
                               "held_out_ratio": interval(held), "merges_ratio": interval(merges),
                               **({"peak_rss_ratio": interval([max(s[True]["peak_rss_mib"].values())
                                                                / max(s[False]["peak_rss_mib"].values())
                                                                for s in pairs])}
                                  if all("peak_rss_mib" in s[a] for s in pairs for a in s) else {}),
                               "held_out_within_5pct": sum(x <= 1.05 for x in held),
                               "merges_at_least_80pct": sum(x >= 0.8 for x in merges)})
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
