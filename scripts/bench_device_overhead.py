#!/usr/bin/env python3
"""What the daemon costs on a device: tokens/s of a bare torch training loop, the daemon's learner, and a whole
daemon, side by side on the same model and device, for cpu and for xla (torch_xla's CPU runtime).

    python scripts/bench_device_overhead.py                       # cpu and xla, 4 repetitions
    python scripts/bench_device_overhead.py --devices cpu --steps 60

- bare: the textbook loop: batch to the device, forward (autocast on bf16), backward, clip, AdamW step, zero
  grads, ``torch_xla.sync()`` on xla; the loss is read every 10 steps, as a logging loop would.
- learner: ``Learner.train_step()`` in a loop (what the daemon's training loop calls; it reads the loss every step).
- lagged: ``Learner.train_step_lagged()``: the same steps, the loss read one step late, so the host traces the
  next step while the device runs this one.
- daemon: ``atoll start`` alone, ``--max-steps``, every daemon default except those listed in the JSON: outer
  rounds every H steps, a held-out evaluation and a checkpoint after each, progress records, the DHT; tokens/s
  from its metrics.jsonl timestamps, over the same number of steps, after its first round (warm-up).

The bare loop and both learners run in one process (one torch thread), alternating blocks of 10 steps in
ABC CBA order, so that whatever else runs on the machine slows them alike. The daemon runs in its own processes,
bracketed: pair, daemon, pair, daemon, ..., pair, and each daemon run is compared with the mean of the pair runs
just before and just after it (a slow drift of the machine's load weighs on both sides alike). All use the same model, batch size and precision (the daemon's default:
fp32 on cpu, bf16 autocast on xla); the first ``--warmup`` steps (graph compilation on xla) are excluded.
Ratios to the bare loop are taken within each repetition; the mean with a 95% interval over repetitions, and the
median, are reported. torch_xla's
CPU runtime is held to one thread too (``XLA_FLAGS``, unless set). xla runs with the xla venv's interpreter
(``make test-xla`` builds it) and this clone's code on PYTHONPATH.
Writes docs/results/bench_device_overhead.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bars import each  # noqa: E402
from stats import fmt, interval  # noqa: E402
LOG_EVERY = 10
KINDS = ("bare", "learner", "lagged", "daemon")
# torch_xla's CPU runtime would use every core; one thread, like torch's, makes the xla runs comparable with the
# cpu ones and far less sensitive to other load on a small machine (a multi-threaded step waits for its slowest
# thread).
XLA_CPU_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def default_xla_python() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atoll", "venv-xla", "bin", "python")


# ---- workers (run in a child process) -----------------------------------------------------------------------------
def _setup(device_name: str, model: str):
    import torch

    torch.set_num_threads(1)
    from atoll.models.configs import MODELS
    from atoll.models.data import Corpus, load_corpus
    from atoll.node.config import RunConfig
    from atoll.node.device import resolve_device

    run = RunConfig(model=model)
    tokens, _ = load_corpus("builtin")
    return run, resolve_device(device_name), Corpus(tokens, MODELS[model].seq_len, run.num_shards)


class BareLoop:
    """The textbook loop: batch to the device, forward (under autocast on bf16), backward, clip, AdamW, zero
    grads, ``torch_xla.sync()`` on xla. The loss is read every ``LOG_EVERY`` steps, as a logging loop would."""

    def __init__(self, run, device, corpus, batch_size: int) -> None:
        import torch

        from atoll.models.configs import get_model_config
        from atoll.models.gpt import GPT

        torch.manual_seed(run.seed)
        self.device, self.corpus, self.batch_size = device, corpus, batch_size
        self.model = GPT(get_model_config(run.model)).to(device.torch_device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=run.inner_lr, betas=(0.9, 0.95),
                                     weight_decay=run.weight_decay)
        self.i, self.loss = 0, None

    def step(self) -> None:
        import torch

        dev, batch_size = self.device.torch_device, self.batch_size
        batch = self.corpus.batch_at(0, self.i * batch_size, batch_size)
        x, y = batch[:, :-1].to(dev), batch[:, 1:].to(dev)
        with self.device.autocast():
            loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.device.sync()
        self.loss = loss.detach()
        self.i += 1
        if self.i % LOG_EVERY == 0:
            self.drain()

    def drain(self) -> float:
        return float(self.loss)  # waits for the device


def worker_pair(args: argparse.Namespace) -> dict:
    """The bare loop, the daemon's learner (``train_step``: this step's loss) and the learner with the loss read
    one step late (``train_step_lagged``) in one process on one device, alternating blocks of ``LOG_EVERY`` steps
    (ABC CBA order), so that whatever else runs on the machine slows all of them alike."""
    from atoll.node.learner import Learner

    run, device, corpus = _setup(args.device, args.model)
    bare = BareLoop(run, device, corpus, args.batch_size)
    learner = Learner(run, device, corpus, 0, args.batch_size)
    lagged = Learner(run, device, corpus, 0, args.batch_size)
    for _ in range(args.warmup):
        bare.step()
        learner.train_step()
        lagged.train_step_lagged()
    bare.drain()
    lagged.train_step()
    kinds = ("bare", "learner", "lagged")
    seconds = dict.fromkeys(kinds, 0.0)
    blocks = -(-args.steps // LOG_EVERY)
    for b in range(blocks):
        n = min(LOG_EVERY, args.steps - b * LOG_EVERY)
        for kind in (kinds if b % 2 == 0 else kinds[::-1]):
            t0 = time.perf_counter()
            if kind == "bare":
                for _ in range(n):
                    bare.step()
                bare.drain()
            elif kind == "learner":
                for _ in range(n):
                    learner.train_step()
            else:
                for _ in range(n - 1):
                    lagged.train_step_lagged()
                lagged.train_step()  # the block ends with the device drained, like the others
            seconds[kind] += time.perf_counter() - t0
    tokens = args.steps * args.batch_size * corpus.seq_len
    return {kind: {"tokens_per_s": tokens / s, "seconds": s} for kind, s in seconds.items()} | {
        "compilations": device.compilations()}


# ---- the driver ---------------------------------------------------------------------------------------------------
def run_pair(python: str, device: str, args: argparse.Namespace) -> dict:
    cmd = [python, __file__, "--worker", "pair", "--device", device, "--model", args.model, "--batch-size",
           str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=child_env())
    if out.returncode != 0:
        raise RuntimeError(f"bare/learner on {device} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_daemon(python: str, device: str, args: argparse.Namespace) -> dict:
    # Its warm-up also covers the first round (the first held-out evaluation compiles its graph on xla).
    sync_every = int(args.daemon_args[args.daemon_args.index("--sync-every") + 1]) \
        if "--sync-every" in args.daemon_args else 50
    warmup = args.warmup + sync_every
    with tempfile.TemporaryDirectory(prefix="atoll-bench-") as tmp:
        cmd = [python, "-m", "atoll.node.cli", "start", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir",
               tmp, "--device", device, "--model", args.model, "--batch-size", str(args.batch_size), "--max-steps",
               str(warmup + args.steps), "--threads", "1", *args.daemon_args]
        log = Path(tmp) / "daemon.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=child_env(), start_new_session=True)
            try:
                code = proc.wait(3600)
            finally:  # the daemon's process group (its DHT process, p2pd) never outlives the benchmark
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if code != 0:
            raise RuntimeError(f"daemon on {device} exited with {code}:\n{log.read_text()[-3000:]}")
        metrics = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m and "event" not in m and m["step"] >= warmup]
    round_steps = {m["step"] for m in metrics if m.get("event") == "round" and m["step"] >= warmup}
    first, last = steps[0], steps[-1]
    seconds = last["time"] - first["time"]
    # Its metrics come every 10 steps and a round runs right after a step's metric: split the intervals into
    # those with a round and those without, to tell the cost of training from the cost of rounds.
    plain, with_round = [], []
    for a, b in zip(steps, steps[1:]):
        (with_round if a["step"] in round_steps else plain).append((b["time"] - a["time"]) / (b["step"] - a["step"]))
    if not plain:
        raise SystemExit("bench_device_overhead: the daemon had a round in every 10 steps; use a longer --sync-every")
    step_s = statistics.median(plain)
    round_s = [10 * (t - step_s) for t in with_round]
    return {"tokens_per_s": (last["tokens"] - first["tokens"]) / seconds, "seconds": seconds,
            "steps": last["step"] - first["step"], "rounds": len(with_round),
            "between_rounds_tokens_per_s": args.batch_size * corpus_seq_len(args) / step_s,
            "round_seconds": statistics.median(round_s) if round_s else None,
            "round_cost_in_steps": statistics.median(round_s) / step_s if round_s else None}


def corpus_seq_len(args: argparse.Namespace) -> int:
    from atoll.models.configs import get_model_config

    return get_model_config(args.model).seq_len


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")
    env.setdefault("XLA_FLAGS", XLA_CPU_ONE_THREAD)
    env["PYTHONUNBUFFERED"] = "1"
    # The xla venv holds dependencies only; this clone's code comes from build/xla-path, as in `make test-xla`.
    env["PYTHONPATH"] = str(ROOT / "build" / "xla-path")
    return env


def check_xla_python(python: str) -> None:
    if not Path(python).exists():
        raise SystemExit(f"bench_device_overhead: no xla interpreter at {python}: run `make test-xla` first "
                         "(or pass --xla-python)")
    shim = ROOT / "build" / "xla-path" / "atoll"
    shim.mkdir(parents=True, exist_ok=True)
    for package in ("node", "protocols", "models"):
        if not (shim / package).is_symlink():
            (shim / package).symlink_to(Path("..", "..", "..", package))
    out = subprocess.run([python, "-c", "import atoll.node, torch_xla; print(atoll.node.__file__)"],
                         capture_output=True, text=True, env=child_env())
    if out.returncode != 0 or Path(out.stdout.strip()).resolve().parent != (ROOT / "node").resolve():
        raise SystemExit(f"bench_device_overhead: {python} does not import this clone's atoll "
                         f"({out.stdout.strip() or out.stderr.strip()[-300:]})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = list(result["devices"])
    kinds = list(KINDS)
    fig, axes = plt.subplots(1, len(devices), figsize=(5 * len(devices), 4.5), squeeze=False)
    for ax, device in zip(axes[0], devices):
        d = result["devices"][device]
        med = [d[k]["median_tokens_per_s"] for k in kinds]
        lo = [m - min(d[k]["tokens_per_s"]) for m, k in zip(med, kinds)]
        hi = [max(d[k]["tokens_per_s"]) - m for m, k in zip(med, kinds)]
        bars = ax.bar(kinds, med, yerr=[lo, hi], capsize=6, color=["#888888", "#4c72b0", "#55a868", "#dd8452"])
        for bar, k in zip(bars, kinds):
            label = "1" if k == "bare" else f"{d['ratio_' + k]['median']:.3f}×"
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() / 2, label, ha="center", va="center",
                    color="white", fontweight="bold")
        ax.set_title(f"{device} ({d['precision']}), model {result['model']}, batch {result['batch_size']}")
        ax.set_ylabel("tokens/s (median, min–max)")
    fig.suptitle("the daemon's learner and a whole daemon vs a bare torch loop (labels: median per-run ratio)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="cpu,xla")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="measured inner steps per run")
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from the measurement (compilation)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--daemon-args", nargs=argparse.REMAINDER, default=["--algorithm", "diloco", "--sync-every", "50"],
                   help="extra flags of the daemon variant (last on the command line)")
    p.add_argument("--xla-python", default=default_xla_python())
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_device_overhead"))
    p.add_argument("--worker", choices=("pair",), help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of --out, run nothing")
    args = p.parse_args()

    if args.replot:
        out = Path(args.out)
        plot(json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".png"))
        return
    if args.worker:
        print(json.dumps(worker_pair(args)))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: children are ended on the way out

    devices = [d for d in args.devices.split(",") if d]
    pythons = {d: args.xla_python if d == "xla" else sys.executable for d in devices}
    if "xla" in devices:
        check_xla_python(args.xla_python)
    runs: dict[str, list[dict]] = {d: [] for d in devices}
    load_before = os.getloadavg()
    started = time.time()
    for device in each(devices, "devices"):
        before = run_pair(pythons[device], device, args)
        for rep in range(args.repeats):
            daemon = run_daemon(pythons[device], device, args)
            after = run_pair(pythons[device], device, args)
            # The daemon run against the mean of the pair runs that bracket it.
            r = {k: {"tokens_per_s": (before[k]["tokens_per_s"] + after[k]["tokens_per_s"]) / 2,
                     "before": before[k]["tokens_per_s"], "after": after[k]["tokens_per_s"]} for k in KINDS[:3]}
            r |= {"daemon": daemon, "compilations": after["compilations"], "loadavg": os.getloadavg()}
            runs[device].append(r)
            before = after
            print(f"rep {rep + 1}/{args.repeats} {device:4s} " + "  ".join(
                f"{k} {r[k]['tokens_per_s']:7.0f}" for k in KINDS) + " tokens/s", flush=True)

    result = {
        "command": "python scripts/bench_device_overhead.py " + " ".join(sys.argv[1:]),
        "model": args.model, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats, "daemon_args": args.daemon_args, "threads": 1,
        "xla_flags": child_env()["XLA_FLAGS"],
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "minutes": (time.time() - started) / 60,
        "devices": {},
    }
    for device in devices:
        d: dict = {"python": pythons[device], "precision": "bf16" if device == "xla" else "fp32", "runs": runs[device]}
        for kind in KINDS:
            values = [r[kind]["tokens_per_s"] for r in runs[device]]
            d[kind] = {"tokens_per_s": values, "median_tokens_per_s": statistics.median(values)}
        for kind in KINDS[1:]:
            ratios = [r[kind]["tokens_per_s"] / r["bare"]["tokens_per_s"] for r in runs[device]]
            d[f"ratio_{kind}"] = {"per_run": ratios, "median": statistics.median(ratios), **interval(ratios),
                                  "runs_within_3pct": sum(x >= 0.97 for x in ratios)}
            d[f"overhead_{kind}_pct"] = 100 * (1 - statistics.median(ratios))
        between = [r["daemon"]["between_rounds_tokens_per_s"] / r["bare"]["tokens_per_s"] for r in runs[device]]
        cost = [r["daemon"]["round_cost_in_steps"] for r in runs[device] if r["daemon"]["round_cost_in_steps"]]
        d["ratio_daemon_between_rounds"] = {"per_run": between, "median": statistics.median(between)}
        d["round_cost_in_steps"] = {"per_run": cost, "median": statistics.median(cost) if cost else None}
        if cost:  # what the same daemon would cost at a longer sync period (derived, not measured)
            b, c = statistics.median(between), statistics.median(cost)
            d["ratio_daemon_derived"] = {str(h): b * h / (h + c) for h in (50, 100, 500)}
        result["devices"][device] = d
        print(f"{device}: bare {d['bare']['median_tokens_per_s']:.0f} tokens/s; learner "
              f"{fmt(d['ratio_learner'])}x, lagged {fmt(d['ratio_lagged'])}x, daemon {fmt(d['ratio_daemon'])}x of bare (mean per run, "
              f"95% interval; daemon within 3% in {d['ratio_daemon']['runs_within_3pct']} of {args.repeats}); "
              f"daemon between rounds {d['ratio_daemon_between_rounds']['median']:.3f}x, a round costs "
              f"{d['round_cost_in_steps']['median'] or float('nan'):.1f} steps")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
