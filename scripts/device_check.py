#!/usr/bin/env python3
"""The accelerator check: everything atoll measures on a CUDA GPU, in one command, into one JSON.

    bash scripts/device_check.sh                         # on the GPU machine: wheels, paths, then this
    python -m scripts.device_check --dry-run --out DIR   # the same sections on this CPU, tiny (make test)

Sections, each in its own process with its own time limit, so that one that breaks or hangs leaves the others
their time, and the JSON is rewritten after each one (what finished is kept if the whole run is cut short):

1. ``correctness``: the tests marked ``device`` (learner, trainee, codecs, ``atoll.Island``, checkpoints) with
   ``ATOLL_TEST_DEVICE=cuda``: the CPU's assertions on the GPU.
2. ``swarm``: three real daemons (``atoll start --device cuda``) on the one GPU, decoupled rounds for a minute:
   rounds merged, replicas identical where two daemons recorded the same round, tokens/s, time blocked.
3. ``overhead``: the learner's tokens/s against a bare torch loop on the same GPU and model
   (``bench_device_overhead.py``), and the int4 codec on GPU tensors against host tensors
   (``bench_codec_device.py``).
4. ``quality``: ddp, diloco and decoupled (the delta rule, and overwriting) in one process
   (``inproc_swarm.py``), at equal tokens, on a ≥ 100M-parameter Llama on BPE data: held-out loss ratios to ddp.
   It runs last and takes the time the others left. ``--overwrite`` adds decoupled with the overwrite rule.

``--dry-run`` runs every section on the CPU at tiny sizes (nano, the built-in corpus, seconds each) and only
collects the device tests (they run in ``make test`` anyway), so that the check cannot rot unnoticed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from scripts.results import pyplot, save_figure, write_result

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("correctness", "swarm", "overhead", "quality")
QUALITY_MIN = 120  # seconds the quality section is always left


def gpu_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {"gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                  "cuda_version": torch.version.cuda, "sms": props.multi_processor_count}
    return facts


# ---- sections (each runs in its own process: ``--section NAME``) ---------------------------------------------------
def section_correctness(args: argparse.Namespace) -> dict:
    xml = Path(args.work) / "device-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device", "tests/unit",
           "tests/integration"]
    cmd += ["--collect-only"] if args.dry_run else [f"--junitxml={xml}"]
    env = os.environ | {"ATOLL_TEST_DEVICE": args.device}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = {"command": " ".join(cmd[1:]), "device": args.device, "rc": proc.returncode,
           "seconds": round(time.perf_counter() - t0, 1), "tail": (proc.stdout + proc.stderr)[-3000:]}
    if xml.exists() and not args.dry_run:
        import xml.etree.ElementTree as ET

        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        out |= {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
    elif args.dry_run:
        out["collected"] = sum(1 for line in proc.stdout.splitlines() if "::" in line)
    return out


def section_swarm(args: argparse.Namespace) -> dict:
    from scripts.swarm import LocalSwarm, peer_id, summary, wait_for

    model, duration = ("nano", 20.0) if args.dry_run else (args.swarm_model, args.swarm_seconds)
    common = ["--model", model, "--device", args.device, "--algorithm", "decoupled", "--batch-size",
              str(args.swarm_batch), "--sync-every", "50", "--heartbeat", "1"]
    root = Path(args.work) / "swarm"
    with LocalSwarm(root, common) as swarm:
        for name in ("a", "b", "c"):
            swarm.start(name)
        # The window starts once every daemon trains and merged a round: a joiner's download and first steps on a
        # loaded machine took the whole of a 20 s window once (a dry run with a daemon of 0 steps).
        wait_for(lambda: all(d.rounds() for d in swarm.daemons.values()), 180, "a round merged by every daemon")
        t0 = time.monotonic()
        time.sleep(duration)
        codes = swarm.stop_all()
        wall = time.monotonic() - t0
        rows = summary(swarm)
        by_peer = {peer_id(d): n for n, d in swarm.daemons.items()}
        agree = disagree = 0
        for name, d in swarm.daemons.items():
            for r in d.rounds():
                for other in set(r["members"]) & set(by_peer) - {peer_id(d)}:
                    for o in swarm.daemons[by_peer[other]].rounds():
                        if (o["version"], o["fragment"], set(o["members"])) == (r["version"], r["fragment"],
                                                                                set(r["members"])):
                            same = o["hash"] == r["hash"]
                            agree, disagree = agree + same, disagree + (not same)
        logs = {n: d.log()[-1500:] for n, d in swarm.daemons.items() if codes.get(n) not in (0, None)}
    for row in rows:  # over the daemon's own training time: first to last step record
        steps = [m for m in swarm.daemons[row["daemon"]].metrics() if "loss" in m and "event" not in m]
        span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
        row["tokens_per_s"] = round((steps[-1]["tokens"] - steps[0]["tokens"]) / span, 1) if span > 0 else 0.0
    return {"model": model, "seconds": round(wall, 1), "exit_codes": codes, "daemons": rows,
            "shared_round_records_agreeing": agree, "shared_round_records_differing": disagree,
            "failed_logs": logs}


def _run_script(cmd: list[str], json_path: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-2000:]
    out = {"command": " ".join(cmd[1:]), "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
    if json_path.exists():
        out["result"] = json.loads(json_path.read_text())
    else:
        out["tail"] = tail
    return out


def section_overhead(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    if args.dry_run:
        bench = ["--devices", "cpu", "--model", "nano", "--data", "builtin", "--steps", "20", "--warmup", "2",
                 "--repeats", "1", "--batch-size", "4", "--no-daemon"]  # cuda measures no whole daemon either
        codec = ["--device", "cpu", "--numel", "1000000", "--repeats", "1"]
    else:
        bench = ["--devices", args.device, "--model", args.model, "--data", args.data, "--repeats", "3"]
        codec = ["--device", args.device, "--repeats", "3"]
    learner = _run_script([sys.executable, "-m", "scripts.bench_device_overhead", *bench, "--no-plot",
                           "--out", str(work / "overhead.json")], work / "overhead.json", args.overhead_seconds)
    codecs = _run_script([sys.executable, "-m", "scripts.bench_codec_device", *codec,
                          "--out", str(work / "codec.json")], work / "codec.json", args.codec_seconds)
    return {"learner_vs_bare": learner, "codec": codecs}


def section_quality(args: argparse.Namespace) -> dict:
    from scripts import inproc_swarm

    if args.dry_run:
        sizes = dict(model="nano", data="builtin", batch_size=4, steps=20, sync_every=10, delay=3, warmup=5,
                     eval_batches=2, budget=0.0, precision=None)
    else:
        sizes = dict(model=args.model, data=args.data, batch_size=args.batch_size, steps=100_000,
                     sync_every=args.sync_every, delay=args.delay, warmup=args.warmup, eval_batches=8,
                     budget=args.budget, precision=None)
    configs = inproc_swarm.standard_configs(sizes["delay"], 4, 0.7, 0.9, "int4", args.overwrite or args.dry_run)
    results = inproc_swarm.run_configs(
        configs, model=sizes["model"], data=sizes["data"], device_name=args.device, members=4,
        batch_size=sizes["batch_size"], steps=sizes["steps"], sync_every=sizes["sync_every"],
        inner_lr=args.inner_lr, warmup=sizes["warmup"], eval_batches=sizes["eval_batches"], eval_points=4,
        budget_s=sizes["budget"], precision=sizes["precision"], log=lambda line: print(line, flush=True))
    ns = argparse.Namespace(**(sizes | {"device": args.device, "members": 4, "inner_lr": args.inner_lr}))
    return inproc_swarm.describe(ns, results)


def plot(path: Path) -> Path:
    """Draw a check's JSON: the quality section's held-out curves, and tokens/s of the bare loop, the learner and
    the daemons. Writes the PNG beside the JSON."""
    plt = pyplot()

    doc = json.loads(path.read_text())
    sections = doc["sections"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    quality = sections.get("quality", {})
    for r in quality.get("results", []):
        steps, losses = zip(*r["curve"])
        left.plot(steps, losses, marker="o", label=f"{r['config']['name']} ({r['vs_ddp']:.3f}× ddp)")
    left.set(xlabel="inner steps per learner (equal tokens)", ylabel="held-out loss of the global model",
             title=f"{quality.get('args', {}).get('model', '')}, 4 learners, "
                   f"{doc['machine'].get('gpu', 'cpu')}")
    left.legend(fontsize=8)
    bars, names = [], []
    device = sections.get("overhead", {}).get("learner_vs_bare", {}).get("result", {}).get("devices", {})
    for kind in ("bare", "learner", "lagged"):
        for dev in device.values():
            if kind in dev:
                bars.append(dev[kind]["median_tokens_per_s"] / 1000)
                names.append(f"{kind}\n{dev['model']}")
    for row in sections.get("swarm", {}).get("daemons", []):
        bars.append(row["tokens_per_s"] / 1000)
        names.append(f"daemon {row['daemon']}\n{sections['swarm']['model']}")
    right.bar(range(len(bars)), bars)
    right.set_xticks(range(len(bars)), names, fontsize=8)
    right.set(ylabel="thousand tokens/s", title="one GPU: bare loop, learner, and 3 daemons sharing it")
    fig.tight_layout()
    out = path.with_suffix(".png")
    save_figure(fig, out)
    return out


RUNNERS = {"correctness": section_correctness, "swarm": section_swarm, "overhead": section_overhead,
           "quality": section_quality}


# ---- the orchestrator -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for device_check.json")
    parser.add_argument("--plot", metavar="JSON", help="only draw a check's JSON (a PNG beside it)")
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny sizes")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole check")
    parser.add_argument("--model", default="llama-150m", help="the quality and overhead sections' model")
    parser.add_argument("--data", default=".devdata/code32k", help="a prepared dataset of the model's vocabulary")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per learner step (quality)")
    parser.add_argument("--sync-every", type=int, default=30, help="H of the quality section")
    parser.add_argument("--delay", type=int, default=8, help="steps a decoupled round lands after its snapshot")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--inner-lr", type=float, default=6e-4)
    parser.add_argument("--swarm-model", default="small", help="the three daemons' model")
    parser.add_argument("--swarm-batch", type=int, default=16)
    parser.add_argument("--swarm-seconds", type=float, default=60.0)
    parser.add_argument("--overhead-seconds", type=float, default=80.0)
    parser.add_argument("--codec-seconds", type=float, default=50.0)
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    parser.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--work", help="folder for the sections' own files (daemons, test reports; default: a new "
                        "temporary folder): only device_check.json goes to --out")
    parser.add_argument("--overwrite", action="store_true", help="quality: also decoupled with the overwrite rule")
    args = parser.parse_args(argv)
    if args.plot:
        print(f"device_check: wrote {plot(Path(args.plot))}")
        return 0
    if not args.out:
        parser.error("--out is required")
    args.device = "cpu" if args.dry_run else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        import tempfile

        args.work = tempfile.mkdtemp(prefix="atoll-device-check-")
    if args.section:  # a child: one section, its result as JSON on the last line of stdout
        result = RUNNERS[args.section](args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("device_check: no CUDA device here (use --dry-run on a CPU)", file=sys.stderr)
            return 2
    start = time.monotonic()
    doc = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
           "machine": gpu_facts(), "sections": {}}
    path = out / "device_check.json"
    # The most each section may take; the quality section takes whatever the others left, at least QUALITY_MIN.
    caps = {"correctness": 120, "swarm": args.swarm_seconds + 70,
            "overhead": args.overhead_seconds + args.codec_seconds + 10}
    for name in args.sections:
        left = args.deadline - (time.monotonic() - start)
        quality_min = QUALITY_MIN if "quality" in args.sections and name != "quality" else 0
        limit = max(30.0, min(caps[name], left - quality_min) if name != "quality" else left - 10)
        budget = max(20.0, limit - 45) if name == "quality" else 0.0  # model builds and evaluations on top
        cmd = [sys.executable, "-m", "scripts.device_check", *(argv if argv is not None else sys.argv[1:]), "--section", name,
               "--work", args.work, "--budget", str(budget)]
        print(f"device_check: {name} (limit {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        entry = {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}
        if lines:
            entry |= json.loads(lines[-1][len("RESULT "):])
        else:
            entry["log"] = (stdout + stderr)[-4000:]
        doc["sections"][name] = entry
        doc["seconds"] = round(time.monotonic() - start, 1)
        write_result(path, doc)
        print(f"device_check: {name} rc={rc} in {entry['seconds']} s", flush=True)
    print(f"device_check: wrote {path}")
    return 0 if all(s.get("rc") == 0 for s in doc["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
