#!/usr/bin/env python3
"""How long ``atoll status`` takes as a run grows: from its summaries against from every record, side by side.

    python -m scripts.bench_status [--records 64 256 1024] [--nodes 4] [--repeats 3] [--baseline TREE]

For each repeat and size, ``--nodes`` real hivemind DHT nodes (each its own process and p2pd, with a member's
validators, as every daemon runs) start on loopback, and each is given the signed progress records of ``--records``
members of a private run (``bench_dht_reads.py``'s records; up to 128 members, under the small swarm's one key as
well) and the summaries three of them would publish (``protocols/summary.py``), as the DHT would hold them for a
swarm of that many daemons. On those nodes, in an order
that alternates between repeats, it times:

- ``collect_status`` (``node/ops/status.py``) from a fresh DHT client, reading the summaries only (``--no-peers``) and
  reading every record (``--peers``);
- the whole command, ``atoll status --json --no-peers`` and ``--peers``, each a fresh process: its imports (no torch
  since the light commands, ``protocols/light_import.py``), starting a DHT client and its p2pd, reading, printing;
- ``atoll dashboard``'s first answer: from its process's start until its ``/api/state`` holds a read of the run.

With ``--baseline TREE`` (a checkout of an earlier commit, such as ``git worktree add /tmp/before <commit>``), the
whole command and the dashboard's first answer are also timed from that tree, in the same repeat, side by side in an
order that alternates: the before and after of a change to either.

Writes docs/results/status/bench_status.json and .png (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from scripts.bars import each
from scripts.dht_fill import HOLD_CHUNK, RUN, hold, members, progress_value, signed_records
from scripts.results import pyplot, save_figure, write_result

from atoll.node.ops.status import collect_status
from atoll.protocols.auth import RunKey
from atoll.node.rounds.peers import WRITE_ALL_UP_TO
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import ALL_SHARDS, MAX_EXPIRY, parse_progress, progress_key
from atoll.protocols.summary import SUMMARIZERS, is_summarizer, summary_key, totals

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = ("summaries", "every record")


def summary_records(chains: list[tuple[list, str]]) -> list[tuple[bytes, bytes, bytes, float]]:
    """The summaries the run's summarizers (``is_summarizer`` among ``chains``' peers) would publish: the totals of
    every member's record, signed by each summarizer's chain."""
    peers = [peer for _, peer in chains]
    run_totals = totals([parse_progress(progress_value(peer)) for peer in peers])
    out = []
    key = DHTID.generate(source=summary_key(RUN)).to_bytes()
    for chain, peer in chains:
        if not is_summarizer(peer, peers):
            continue
        value = {"peer_id": peer, **run_totals, "time": float(get_dht_time())}
        record = DHTRecord(key, MSGPackSerializer.dumps(chain[0].local_public_key), MSGPackSerializer.dumps(value),
                           get_dht_time() + MAX_EXPIRY["summary"] - 30)
        out.append((key, chain[0].local_public_key, CompositeValidator(chain).sign_value(record),
                    record.expiration_time))
    assert len(out) == min(SUMMARIZERS, len(chains))
    return out


def small_swarm_records(chains: list[tuple[list, str]]) -> list[tuple[bytes, bytes, bytes, float]]:
    """Each member's progress record under the key a small swarm's daemons write it under as well
    (``records.ALL_SHARDS``): they do while their table holds at most ``peers.WRITE_ALL_UP_TO`` records."""
    if len(chains) > WRITE_ALL_UP_TO:
        return []
    key = DHTID.generate(source=progress_key(RUN, ALL_SHARDS)).to_bytes()
    out = []
    for chain, peer in chains:
        subkey = chain[0].local_public_key
        record = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(progress_value(peer)),
                           get_dht_time() + MAX_EXPIRY["progress"] - 30)
        out.append((key, subkey, CompositeValidator(chain).sign_value(record), record.expiration_time))
    return out


def collect(bootstrap: list[str], run_key: RunKey, list_peers: bool) -> tuple[float, int | None, int]:
    """``collect_status`` from a fresh client: seconds, peers listed (None: totals only), peers in the totals."""
    client = DHT(initial_peers=bootstrap, start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                 record_validators=make_validators(RUN, run_key.issue_token(RUN)))
    try:
        t0 = time.perf_counter()
        doc = collect_status(client, RUN, list_peers)
        seconds = time.perf_counter() - t0
    finally:
        client.shutdown()
    return seconds, None if doc["peers"] is None else len(doc["peers"]), doc["totals"]["peers"]


def command(bootstrap: list[str], list_peers: bool, tree: Path = ROOT) -> tuple[float, int]:
    """``atoll status --json`` as a user runs it (from ``tree``): seconds from the process's start to its exit, peers
    in the totals."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "atoll.node.cli", "status", "--json", "--run-id", RUN,
                          "--peers" if list_peers else "--no-peers", "--initial-peers", *bootstrap],
                         capture_output=True, text=True, timeout=300, cwd=tree)
    seconds = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"atoll status failed: {out.stderr.strip()[-500:]}")
    return seconds, json.loads(out.stdout)["totals"]["peers"]


def dashboard(bootstrap: list[str], tree: Path = ROOT) -> float:
    """Seconds from ``atoll dashboard``'s start (from ``tree``) until its ``/api/state`` holds a read of the run."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "atoll.node.cli", "dashboard", "--run-id", RUN, "--port", "0",
                             "--interval", "60", "--initial-peers", *bootstrap], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=tree)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once its DHT client started: "dashboard of run ... at http://..."
        if "http://" not in line:
            raise RuntimeError(f"atoll dashboard did not start: {line!r}, exit {proc.wait(30)}")
        url = line.split(" at ")[1].split()[0] + "api/state"
        while time.perf_counter() - t0 < 120:
            with urllib.request.urlopen(url, timeout=10) as response:
                state = json.loads(response.read())
            if state["polls"] >= 1 and state["totals"] is not None:
                return time.perf_counter() - t0
            time.sleep(0.01)
        raise RuntimeError("atoll dashboard read nothing in 120 s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(chains: list, nodes: int, run_key: RunKey, order: tuple[str, ...], baseline: Path | None
            ) -> dict[str, dict[str, Any]]:
    records = signed_records(chains) + small_swarm_records(chains) + summary_records(chains)
    trees = [ROOT] if baseline is None else ([ROOT, baseline] if order == VARIANTS else [baseline, ROOT])
    dhts: list[DHT] = []
    try:
        for _ in range(nodes):
            peers = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            record_validators=make_validators(RUN, run_key.issue_token(RUN))))
        for dht in dhts:
            for i in range(0, len(records), HOLD_CHUNK):
                chunk = records[i:i + HOLD_CHUNK]
                assert dht.run_coroutine(functools.partial(hold, chunk)) == len(chunk)
        bootstrap = [str(a) for a in dhts[0].get_visible_maddrs()]
        out = {}
        for variant in order:
            listed = variant == "every record"
            collect_s, peers_listed, counted = collect(bootstrap, run_key, listed)
            timed = {tree: command(bootstrap, listed, tree) for tree in trees}
            out[variant] = {"collect_s": collect_s, "command_s": timed[ROOT][0], "peers_listed": peers_listed,
                            "peers_counted": min(counted, *(c for _, c in timed.values()))}
            if baseline is not None:
                out[variant]["baseline_command_s"] = timed[baseline][0]
            if not listed:  # the dashboard reads as status does by default: the summaries past 64 members
                shown = {tree: dashboard(bootstrap, tree) for tree in trees}
                out[variant]["dashboard_s"] = shown[ROOT]
                if baseline is not None:
                    out[variant]["baseline_dashboard_s"] = shown[baseline]
        return out
    finally:
        for dht in dhts:
            dht.shutdown()


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({r["records"] for r in runs}):
        for variant in VARIANTS:
            mine = [r for r in runs if r["records"] == n and r["variant"] == variant]
            row: dict[str, Any] = {"records": n, "variant": variant, "repeats": len(mine)}
            for k in ("collect_s", "command_s", "baseline_command_s", "dashboard_s", "baseline_dashboard_s"):
                values = [r[k] for r in mine if k in r]
                if values:
                    row[k], row[k + "_range"] = statistics.fmean(values), [min(values), max(values)]
            for k in ("command_s", "dashboard_s"):  # after / before, per repeat
                ratios = [r[k] / r["baseline_" + k] for r in mine if "baseline_" + k in r]
                if ratios:
                    row[k + "_vs_baseline"], row[k + "_vs_baseline_range"] = (statistics.fmean(ratios),
                                                                               [min(ratios), max(ratios)])
            row["peers_counted_min"] = min(r["peers_counted"] for r in mine)
            rows.append(row)
        pairs = [(a, b) for a in runs for b in runs if a["records"] == b["records"] == n
                 and a["repeat"] == b["repeat"] and a["variant"] == "summaries" and b["variant"] == "every record"]
        for k in ("collect_s", "command_s"):
            ratios = [a[k] / b[k] for a, b in pairs]
            rows[-2][k + "_ratio"] = statistics.fmean(ratios)
            rows[-2][k + "_ratio_range"] = [min(ratios), max(ratios)]
    return rows


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = [(0, "collect_s", variant, f"C{i}", "-") for i, variant in enumerate(VARIANTS)]
    for i, variant in enumerate(VARIANTS):
        lines += [(1, "command_s", variant, f"C{i}", "-"), (1, "baseline_command_s", variant, f"C{i}", "--")]
    lines += [(1, "dashboard_s", VARIANTS[0], "C2", "-"), (1, "baseline_dashboard_s", VARIANTS[0], "C2", "--")]
    for panel, key, variant, color, style in lines:
        rows = [r for r in doc["rows"] if r["variant"] == variant and key in r]
        if not rows:
            continue
        xs, ys = [r["records"] for r in rows], [r[key] for r in rows]
        lo = [y - r[key + "_range"][0] for y, r in zip(ys, rows)]
        hi = [r[key + "_range"][1] - y for y, r in zip(ys, rows)]
        what = {"collect_s": "", "command_s": "status, ", "baseline_command_s": "status before, ",
                "dashboard_s": "dashboard's first answer", "baseline_dashboard_s": "dashboard before"}[key]
        label = what + ("" if "dashboard" in key else variant)
        axes[panel].errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=color, ls=style, label=label)
    for ax, title in zip(axes, ("reading (collect_status), s", "the whole command from a fresh process, s")):
        ax.axhline(1.5, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        xs = sorted({r["records"] for r in doc["rows"]})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("members (progress records)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    before = f"; dashed: before, at {doc['baseline'].split()[0]}" if doc.get("baseline") else ""
    fig.suptitle(f"bench_status: {doc['nodes']} DHT nodes, mean of {doc['repeats']} repeats (bars: min-max){before}",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", type=Path, default=None, metavar="TREE",
                    help="a checkout of an earlier commit: its whole command and dashboard timed beside this tree's")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "status" / "bench_status")
    args = ap.parse_args()
    run_key = RunKey.generate()
    print(f"signing {max(args.records)} members' records...", flush=True)
    everyone = members(run_key, max(args.records))
    runs = []
    for repeat in each(range(args.repeats), "repeats"):
        for n in args.records:
            order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
            for variant, figures in measure(everyone[:n], args.nodes, run_key, order, args.baseline).items():
                runs.append({"repeat": repeat, "records": n, "variant": variant, **figures})
                print(f"repeat {repeat} records {n:5d} {variant:>12}: collect {figures['collect_s']:.2f} s, "
                      f"command {figures['command_s']:.2f} s, {figures['peers_counted']} peers counted, "
                      f"{figures['peers_listed']} listed; " + ", ".join(
                          f"{k} {v:.2f}" for k, v in figures.items() if "dashboard" in k or "baseline" in k),
                      flush=True)
    doc = {"nodes": args.nodes, "repeats": args.repeats, "rows": summarize(runs),
           "baseline": None if args.baseline is None else subprocess.run(
               ["git", "-C", str(args.baseline), "log", "-1", "--format=%h %s"], capture_output=True,
               text=True).stdout.strip()[:120],
           "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out.with_suffix(".json"), doc)
    plot(doc, args.out.with_suffix(".png"))
    for row in doc["rows"]:
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_range")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
