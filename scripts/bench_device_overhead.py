#!/usr/bin/env python3
"""What the daemon costs on a device: tokens/s of a bare torch training loop, the daemon's learner, and a whole
daemon, side by side on the same model and device, for cpu, xla (torch_xla's CPU runtime) and cuda.

    python -m scripts.bench_device_overhead                       # cpu and xla, 4 repetitions
    python -m scripts.bench_device_overhead --devices cpu --steps 60
    python -m scripts.bench_device_overhead --devices cuda --model llama-150m --data DATASET --out OUT.json
    python -m scripts.bench_device_overhead --devices cpu --model nano --no-daemon --steps 20 --warmup 2 \
        --repeats 2 --batch-size 2 --out /tmp/overhead.json --no-plot      # the CPU dry run of the cuda path

- bare: the textbook loop: batch to the device, forward (autocast on bf16), backward, clip, AdamW step, zero
  grads, ``torch_xla.sync()`` on xla; the loss is read every 10 steps, as a logging loop would. On cuda it is the
  loop an ML engineer would write: the batch pinned and copied with ``non_blocking``, bf16 autocast (the
  learner's default there) and AdamW built as the learner builds it (``capturable``; ``--bare-optimizer fused``
  for ``fused=True`` instead), and no host sync but that loss read.
- learner: ``Learner.train_step()`` in a loop (what the daemon's training loop calls; it reads the loss every step).
- lagged: ``Learner.train_step_lagged()``: the same steps, the loss read one step late, so the host traces (on
  cuda: launches) the next step while the device runs this one. A daemon on an accelerator trains this way.
- daemon: ``atoll start`` alone, ``--max-steps``, every daemon default except those listed in the JSON: outer
  rounds every H steps, a held-out evaluation and a checkpoint after each, progress records, the DHT; tokens/s
  from its metrics.jsonl timestamps, over the same number of steps, after its first round (warm-up). Not run on
  cuda (a swarm of daemons on a GPU is measured elsewhere), nor with ``--no-daemon``.

The bare loop and both learners run in one process (one torch thread), alternating blocks of 10 steps in
ABC CBA order, so that whatever else runs on the machine slows them alike. The daemon runs in its own processes,
bracketed: pair, daemon, pair, daemon, ..., pair, and each daemon run is compared with the mean of the pair runs
just before and just after it (a slow drift of the machine's load weighs on both sides alike). Without the daemon
(cuda, ``--no-daemon``) one process runs every repetition, one after another, after one warm-up. All use the same
model, batch size and precision (the daemon's default: fp32 on cpu, bf16 autocast on xla and cuda); the first
``--warmup`` steps (graph compilation on xla, kernel selection on cuda) are excluded. On cuda the clock is read
only after ``torch.cuda.synchronize()``, at each block's start and end, and ``--max-seconds`` caps the measured
steps: the steps per repetition are cut (to a multiple of 10) when one timed step says they would run longer.
Ratios to the bare loop are taken within each repetition; the mean with a 95% interval over repetitions, and the
median, are reported. torch_xla's CPU runtime is held to one thread too (``XLA_FLAGS``, unless set). xla runs with
the xla venv's interpreter (``make test-xla`` builds it) and this clone's code on PYTHONPATH; cpu and cuda with
this interpreter.

``--data`` is what ``atoll start --data`` takes (``builtin``: bytes, vocabulary 256). A model is only fed data of
its own vocabulary: a prepared dataset's or byte-level data's vocabulary must equal the model's, and the ids of
uint16 ``.bin`` shards must be below it. Bad arguments (a device torch does not see, a vocabulary mismatch, an
unknown model) end the script with one line and exit status 2.
Writes ``--out`` with the suffix .json (and .png unless ``--no-plot``); by default
docs/results/device_overhead/bench_device_overhead.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

ROOT = Path(__file__).resolve().parent.parent
LOG_EVERY = 10
KINDS = ("bare", "learner", "lagged", "daemon")
DEVICES = ("cpu", "xla", "cuda")
# Per device, what an unset --steps, --warmup, --repeats and --max-seconds mean. cuda's fit an H200 in about 45 s
# for llama-150m at batch 8 × 2048 (one process: start, model, 15 warm-up steps and 270 measured ones).
DEFAULTS = {"steps": 100, "warmup": 10, "repeats": 4, "max_seconds": None}
CUDA_DEFAULTS = {"steps": 30, "warmup": 5, "repeats": 3, "max_seconds": 30.0}
CALIBRATION_STEPS = 3  # timed bare steps after the warm-up, for --max-seconds
# torch_xla's CPU runtime would use every core; one thread, like torch's, makes the xla runs comparable with the
# cpu ones and far less sensitive to other load on a small machine (a multi-threaded step waits for its slowest
# thread).
XLA_CPU_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


class BadArgs(Exception):
    """Arguments this script cannot run with: one line, exit status 2."""


def default_xla_python() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atoll", "venv-xla", "bin", "python")


def make_model(name: str, seed: int, seq_len: int | None = None):
    """The model ``name`` from ``seed`` on the CPU and its shape, as the daemon builds it; ``seq_len`` overrides a
    preset's sequence length (``BadArgs`` for a model that is not a preset)."""
    from atoll.models.configs import MODELS, instantiate
    from atoll.models.registry import ModelError, build_model, shape_of

    try:
        if seq_len is None:
            return build_model(name, seed)
    except ModelError as e:
        raise BadArgs(f"--model: {e}") from None
    import torch

    if name not in MODELS:
        raise BadArgs(f"--seq-len: only a preset's sequence length can be changed, and {name!r} is not a preset")
    torch.manual_seed(seed)
    model = instantiate(dataclasses.replace(MODELS[name], seq_len=seq_len))
    return model, shape_of(model, name)


def model_vocab(name: str) -> int:
    """The vocabulary of model ``name`` (a preset's from its config; anything else is built once)."""
    from atoll.models.configs import MODELS

    if name in MODELS:
        return MODELS[name].vocab_size
    return make_model(name, 0)[1].vocab_size


def data_vocab(spec: str) -> tuple[int, bool]:
    """(vocabulary of the data ``spec``, whether it is exact): a prepared dataset's tokenizer's and byte-level
    data's are; uint16 ``.bin`` shards only say their largest id + 1. ``BadArgs`` for data that does not load."""
    from atoll.models.data import load_corpus, tokenizer_of
    from atoll.models.dataset import is_prepared, read_manifest

    if spec == "builtin":
        return 256, True
    try:
        if is_prepared(Path(spec)):
            return read_manifest(spec).vocab_size, True
        exact = tokenizer_of(spec) != ""
        return load_corpus(spec)[1], exact
    except ValueError as e:
        raise BadArgs(f"--data: {e}") from None


def check_vocab(model: str, vocab: int, data: str, data_vocab_size: int, exact: bool) -> None:
    """``BadArgs`` unless the data's vocabulary is the model's (or, for ``.bin`` shards, fits in it)."""
    if exact and data_vocab_size != vocab:
        raise BadArgs(f"--data {data!r} has a vocabulary of {data_vocab_size} tokens but model {model!r} embeds "
                      f"{vocab}: give the model data of its own tokenizer")
    if data_vocab_size > vocab:
        raise BadArgs(f"--data {data!r}: tokens go up to {data_vocab_size - 1} but model {model!r} has vocab {vocab}")


# ---- workers (run in a child process) -----------------------------------------------------------------------------
def _setup(args: argparse.Namespace):
    """The run, device, corpus and model (on the CPU) of a worker; torch on one thread, as a daemon's default."""
    import torch

    torch.set_num_threads(1)
    from atoll.models.data import Corpus, load_corpus
    from atoll.node.config import RunConfig
    from atoll.node.device import resolve_device

    run = RunConfig(model=args.model, data=args.data)
    device = resolve_device(args.device)
    model, shape = make_model(args.model, run.seed, args.seq_len)
    tokens, vocab = load_corpus(args.data)
    check_vocab(args.model, shape.vocab_size, args.data, *data_vocab(args.data))
    return run, device, Corpus(tokens, shape.seq_len, run.num_shards), model, shape


class BareLoop:
    """The textbook loop: batch to the device, forward (under autocast on bf16), backward, clip, AdamW, zero
    grads, ``torch_xla.sync()`` on xla. The loss is read every ``LOG_EVERY`` steps, as a logging loop would.

    On cuda the batch is pinned and copied with ``non_blocking`` (a blocking copy from pageable memory would wait
    for the device every step), and AdamW is built as the learner builds it there (``capturable``), or
    ``fused=True`` with ``optimizer="fused"``; nothing else waits for the device."""

    def __init__(self, run, device, corpus, batch_size: int, model, optimizer: str = "learner") -> None:
        import torch

        self.device, self.corpus, self.batch_size = device, corpus, batch_size
        self.cuda = device.kind == "cuda"
        self.model = model.to(device.torch_device)
        options = {}
        if self.cuda:  # the learner's construction (learner.py), unless asked for the fused kernel
            options = {"fused": True} if optimizer == "fused" else {"capturable": True}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=run.inner_lr, betas=(0.9, 0.95),
                                     weight_decay=run.weight_decay, **options)
        self.i, self.loss = 0, None

    def step(self) -> None:
        import torch

        dev, batch_size = self.device.torch_device, self.batch_size
        batch = self.corpus.batch_at(0, self.i * batch_size, batch_size)
        if self.cuda:
            batch = batch.pin_memory().to(dev, non_blocking=True)
            x, y = batch[:, :-1], batch[:, 1:]
        else:
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


def describe_optimizer(opt) -> str:
    d = opt.defaults
    flags = [k for k in ("capturable", "foreach", "fused") if d.get(k)]
    return f"AdamW(betas={tuple(d['betas'])}, weight_decay={d['weight_decay']}" + \
        "".join(f", {k}=True" for k in flags) + ")"


def worker_pair(args: argparse.Namespace) -> dict:
    """The bare loop, the daemon's learner (``train_step``: this step's loss) and the learner with the loss read
    one step late (``train_step_lagged``) in one process on one device, alternating blocks of ``LOG_EVERY`` steps
    (ABC CBA order, continued across ``--repeats``), so that whatever else runs on the machine slows all of them
    alike. Returns per repetition each kind's tokens/s and seconds, and what was run."""
    import torch

    from atoll.node.island.learner import Learner

    run, device, corpus, model, shape = _setup(args)
    cuda = device.kind == "cuda"
    fence = torch.cuda.synchronize if cuda else (lambda: None)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # One initialisation, three copies: the same θ₀ for each, as three builds from the seed would give.
    bare = BareLoop(run, device, corpus, args.batch_size, copy.deepcopy(model), args.bare_optimizer)
    learner = Learner(run, device, corpus, 0, args.batch_size, model=copy.deepcopy(model))
    lagged = Learner(run, device, corpus, 0, args.batch_size, model=model)
    del model
    started = time.perf_counter()
    for _ in range(args.warmup):
        bare.step()
        learner.train_step()
        lagged.train_step_lagged()
    bare.drain()
    lagged.train_step()
    fence()
    warmup_seconds = time.perf_counter() - started
    steps, step_seconds = args.steps, None
    if args.max_seconds:  # one bare step's time says how many measured steps fit
        t0 = time.perf_counter()
        for _ in range(CALIBRATION_STEPS):
            bare.step()
        bare.drain()
        fence()
        step_seconds = (time.perf_counter() - t0) / CALIBRATION_STEPS
        fit = int(args.max_seconds / (3 * args.repeats * step_seconds)) // LOG_EVERY * LOG_EVERY
        steps = max(LOG_EVERY, min(steps, fit))
    kinds = ("bare", "learner", "lagged")
    tokens = steps * args.batch_size * corpus.seq_len
    blocks, block, repeats, last = -(-steps // LOG_EVERY), 0, [], {}
    for _ in range(args.repeats):
        seconds = dict.fromkeys(kinds, 0.0)
        for b in range(blocks):
            n = min(LOG_EVERY, steps - b * LOG_EVERY)
            for kind in (kinds if block % 2 == 0 else kinds[::-1]):
                fence()
                t0 = time.perf_counter()
                if kind == "bare":
                    for _ in range(n):
                        bare.step()
                    last[kind] = bare.drain()
                elif kind == "learner":
                    for _ in range(n):
                        last[kind] = learner.train_step()
                else:
                    for _ in range(n - 1):
                        lagged.train_step_lagged()
                    last[kind] = lagged.train_step()  # the block ends with the device drained, like the others
                fence()
                seconds[kind] += time.perf_counter() - t0
            block += 1
        repeats.append({kind: {"tokens_per_s": tokens / s, "seconds": s} for kind, s in seconds.items()})
    env = {"device": device.describe(), "precision": learner.precision, "torch": torch.__version__,
           "model": args.model, "params": params, "vocab_size": shape.vocab_size, "seq_len": corpus.seq_len,
           "batch_size": args.batch_size, "tokens_per_step": args.batch_size * corpus.seq_len, "data": args.data,
           "steps": steps, "steps_asked": args.steps, "warmup": args.warmup, "warmup_seconds": warmup_seconds,
           "calibration_step_seconds": step_seconds, "max_seconds": args.max_seconds, "torch_threads": 1,
           "bare_optimizer": describe_optimizer(bare.opt), "learner_optimizer": describe_optimizer(learner.optimizer),
           "last_loss": last}
    if cuda:
        env |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
                "bare_batch": "pinned, non_blocking", "learner_batch": "Device.upload (non_blocking, pageable)",
                "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
    return {"repeats": repeats, "compilations": device.compilations(), "env": env}


# ---- the driver ---------------------------------------------------------------------------------------------------
def run_pair(python: str, device: str, args: argparse.Namespace, repeats: int = 1) -> dict:
    """The bare loop and both learners on ``device`` in a child process (``worker_pair``), ``repeats`` times."""
    cmd = [python, "-m", "scripts.bench_device_overhead", "--worker", "pair", "--device", device, "--model", args.model, "--data", args.data,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--repeats", str(repeats), "--bare-optimizer", args.bare_optimizer]
    if args.seq_len is not None:
        cmd += ["--seq-len", str(args.seq_len)]
    if args.max_seconds:
        cmd += ["--max-seconds", str(args.max_seconds)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT,
                         env=cuda_env() if device == "cuda" else child_env())
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
               tmp, "--device", device, "--model", args.model, "--data", args.data, "--batch-size",
               str(args.batch_size), "--max-steps", str(warmup + args.steps), "--threads", "1", *args.daemon_args]
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


def cuda_env() -> dict:
    """A cuda child's environment: this clone first on PYTHONPATH (atoll need not be installed there)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def check_xla_python(python: str) -> None:
    if not Path(python).exists():
        raise BadArgs(f"no xla interpreter at {python}: run `make test-xla` first (or pass --xla-python)")
    shim = ROOT / "build" / "xla-path" / "atoll"
    shim.mkdir(parents=True, exist_ok=True)
    for package in ("node", "protocols", "models"):
        if not (shim / package).is_symlink():
            (shim / package).symlink_to(Path("..", "..", "..", package))
    out = subprocess.run([python, "-c", "import atoll.node, torch_xla; print(atoll.node.__file__)"],
                         capture_output=True, text=True, env=child_env())
    if out.returncode != 0 or Path(out.stdout.strip()).resolve().parent != (ROOT / "node").resolve():
        detail = (out.stdout.strip() or out.stderr.strip()[-300:]).replace("\n", " ")
        raise BadArgs(f"{python} does not import this clone's atoll ({detail})")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    devices = list(result["devices"])
    colors = {"bare": "#888888", "learner": "#4c72b0", "lagged": "#55a868", "daemon": "#dd8452"}
    fig, axes = plt.subplots(1, len(devices), figsize=(5 * len(devices), 4.5), squeeze=False)
    for ax, device in zip(axes[0], devices):
        d = result["devices"][device]
        kinds = [k for k in KINDS if isinstance(d.get(k), dict)]
        med = [d[k]["median_tokens_per_s"] for k in kinds]
        lo = [m - min(d[k]["tokens_per_s"]) for m, k in zip(med, kinds)]
        hi = [max(d[k]["tokens_per_s"]) - m for m, k in zip(med, kinds)]
        bars = ax.bar(kinds, med, yerr=[lo, hi], capsize=6, color=[colors[k] for k in kinds])
        for bar, k in zip(bars, kinds):
            label = "1" if k == "bare" else f"{d['ratio_' + k]['median']:.3f}×"
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() / 2, label, ha="center", va="center",
                    color="white", fontweight="bold")
        name = d.get("env", {}).get("gpu", device)
        ax.set_title(f"{name} ({d['precision']}), model {d.get('model', result['model'])}, "
                     f"batch {d.get('batch_size', result['batch_size'])}", fontsize=9)
        ax.set_ylabel("tokens/s (median, min–max)")
    fig.suptitle("the daemon's learner and a whole daemon vs a bare torch loop\n(labels: median per-run ratio)",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit status 2, from main
        raise BadArgs(message)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="cpu,xla", help="comma-separated: cpu, xla, cuda")
    p.add_argument("--model", default="tiny", help="a preset (e.g. llama-150m), hf:PATH or package.module:factory")
    p.add_argument("--data", default="builtin", help="what `atoll start --data` takes (default: builtin, bytes)")
    p.add_argument("--seq-len", type=int, help="override the preset's sequence length (not with the daemon)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, help="measured inner steps per kind and repetition (default: 100; 30 on "
                                             "cuda)")
    p.add_argument("--warmup", type=int, help="steps excluded from the measurement (default: 10; 5 on cuda)")
    p.add_argument("--repeats", type=int, help="repetitions (default: 4; 3 on cuda)")
    p.add_argument("--max-seconds", type=float, help="cap on the measured steps' time in one process, by cutting "
                                                    "--steps (default: none; 30 on cuda); 0: no cap")
    p.add_argument("--no-daemon", action="store_true", help="skip the whole daemon (it is always skipped on cuda)")
    p.add_argument("--bare-optimizer", choices=("learner", "fused"), default="learner",
                   help="cuda: the bare loop's AdamW as the learner builds it (capturable), or fused=True")
    p.add_argument("--daemon-args", nargs=argparse.REMAINDER, default=["--algorithm", "diloco", "--sync-every", "50"],
                   help="extra flags of the daemon variant (last on the command line)")
    p.add_argument("--xla-python", default=default_xla_python())
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "device_overhead" / "bench_device_overhead"),
                   help="where the JSON (its suffix made .json) and the PNG (.png) go")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    p.add_argument("--worker", choices=("pair",), help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of --out, run nothing")
    return p.parse_args(argv)


def resolved(args: argparse.Namespace, device: str) -> argparse.Namespace:
    """``args`` with --steps, --warmup, --repeats and --max-seconds as given, or ``device``'s defaults."""
    out = copy.copy(args)
    for key, value in (CUDA_DEFAULTS if device == "cuda" else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(out, key, value)
    return out


def check(args: argparse.Namespace) -> list[str]:
    """The devices to run; ``BadArgs`` for anything that cannot run, before any child starts."""
    devices = [d for d in args.devices.split(",") if d]
    if not devices:
        raise BadArgs("--devices: name at least one of cpu, xla, cuda")
    for d in devices:
        if d not in DEVICES:
            raise BadArgs(f"--devices: unknown {d!r}; known: {', '.join(DEVICES)}")
    if len(set(devices)) != len(devices):
        raise BadArgs(f"--devices: {args.devices!r} names a device twice")
    for key in ("batch_size", "steps", "repeats"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise BadArgs(f"--{key.replace('_', '-')} must be at least 1")
    if args.warmup is not None and args.warmup < 1:
        raise BadArgs("--warmup must be at least 1 (the first steps choose kernels or compile)")
    if args.seq_len is not None and args.seq_len < 1:
        raise BadArgs("--seq-len must be at least 1")
    if args.max_seconds is not None and args.max_seconds < 0:
        raise BadArgs("--max-seconds must not be negative")
    if args.seq_len is not None and not args.no_daemon and any(d != "cuda" for d in devices):
        raise BadArgs("--seq-len: the whole daemon trains at the preset's sequence length; add --no-daemon")
    if "cuda" in devices:
        import torch

        if not torch.cuda.is_available():
            raise BadArgs(f"--devices cuda: torch {torch.__version__} sees no CUDA device here")
    if "xla" in devices:
        check_xla_python(args.xla_python)
    check_vocab(args.model, checked_model_vocab(args.model, args.seq_len), args.data, *data_vocab(args.data))
    return devices


def checked_model_vocab(name: str, seq_len: int | None) -> int:
    """The vocabulary of model ``name``; ``BadArgs`` for a name that is none, or a --seq-len it cannot take."""
    from atoll.models.configs import MODELS
    from atoll.models.registry import ModelError, check_name

    try:
        check_name(name)
    except ModelError as e:
        raise BadArgs(f"--model: {e}") from None
    if seq_len is not None and name not in MODELS:
        raise BadArgs(f"--seq-len: only a preset's sequence length can be changed, and {name!r} is not a preset")
    return model_vocab(name)


def summarise(runs: list[dict], kinds: tuple[str, ...]) -> dict:
    """Each kind's tokens/s over the runs, and each kind's per-run ratio to the bare loop."""
    d: dict = {"runs": runs}
    for kind in kinds:
        values = [r[kind]["tokens_per_s"] for r in runs]
        d[kind] = {"tokens_per_s": values, "median_tokens_per_s": statistics.median(values)}
    for kind in kinds[1:]:
        ratios = [r[kind]["tokens_per_s"] / r["bare"]["tokens_per_s"] for r in runs]
        d[f"ratio_{kind}"] = {"per_run": ratios, "median": statistics.median(ratios), **interval(ratios),
                              "runs_within_3pct": sum(x >= 0.97 for x in ratios)}
        d[f"overhead_{kind}_pct"] = 100 * (1 - statistics.median(ratios))
    return d


def run(args: argparse.Namespace) -> dict:
    """Measure what ``args`` ask for (``parse``'s), write the JSON (and the PNG unless ``--no-plot``) and return the
    result. ``BadArgs`` before anything runs for arguments that cannot."""
    if args.replot:
        out = Path(args.out)
        plot(json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".png"))
        return {}
    devices = check(args)
    pythons = {d: args.xla_python if d == "xla" else sys.executable for d in devices}
    load_before = os.getloadavg()
    started = time.time()
    result = {
                "model": args.model, "data": args.data, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "daemon_args": args.daemon_args, "threads": 1, "xla_flags": child_env()["XLA_FLAGS"], "devices": {},
    }
    for i, device in enumerate(each(devices, "devices")):
        dargs = resolved(args, device)
        if i == 0:  # the first device's settings at the top, as before cuda
            result |= {"steps": dargs.steps, "warmup": dargs.warmup, "repeats": dargs.repeats}
        with_daemon = device != "cuda" and not args.no_daemon
        runs: list[dict] = []
        if with_daemon:
            before = run_pair(pythons[device], device, dargs)
            env = before["env"]
            before = before["repeats"][0] | {"compilations": before["compilations"]}
            for rep in range(dargs.repeats):
                daemon = run_daemon(pythons[device], device, dargs)
                after = run_pair(pythons[device], device, dargs)
                after = after["repeats"][0] | {"compilations": after["compilations"]}
                # The daemon run against the mean of the pair runs that bracket it.
                r = {k: {"tokens_per_s": (before[k]["tokens_per_s"] + after[k]["tokens_per_s"]) / 2,
                         "before": before[k]["tokens_per_s"], "after": after[k]["tokens_per_s"]} for k in KINDS[:3]}
                r |= {"daemon": daemon, "compilations": after["compilations"], "loadavg": os.getloadavg()}
                runs.append(r)
                before = after
                print(f"rep {rep + 1}/{dargs.repeats} {device:4s} " + "  ".join(
                    f"{k} {r[k]['tokens_per_s']:7.0f}" for k in KINDS) + " tokens/s", flush=True)
        else:  # one process, every repetition after one warm-up
            out = run_pair(pythons[device], device, dargs, repeats=dargs.repeats)
            env = out["env"]
            for rep, r in enumerate(out["repeats"]):
                runs.append(r | {"compilations": out["compilations"]})
                print(f"rep {rep + 1}/{dargs.repeats} {device:4s} " + "  ".join(
                    f"{k} {r[k]['tokens_per_s']:7.0f}" for k in KINDS[:3]) + " tokens/s", flush=True)
        kinds = KINDS if with_daemon else KINDS[:3]
        d = {"python": pythons[device], "precision": env["precision"], "model": args.model,
             "batch_size": args.batch_size, "steps": env["steps"], "warmup": dargs.warmup,
             "repeats": dargs.repeats, "env": env,
             "daemon_skipped": None if with_daemon else ("on cuda: a swarm of daemons on a GPU is measured apart"
                                                         if device == "cuda" else "--no-daemon")}
        d |= summarise(runs, kinds)
        if with_daemon:
            between = [r["daemon"]["between_rounds_tokens_per_s"] / r["bare"]["tokens_per_s"] for r in runs]
            cost = [r["daemon"]["round_cost_in_steps"] for r in runs if r["daemon"]["round_cost_in_steps"]]
            d["ratio_daemon_between_rounds"] = {"per_run": between, "median": statistics.median(between)}
            d["round_cost_in_steps"] = {"per_run": cost, "median": statistics.median(cost) if cost else None}
            if cost:  # what the same daemon would cost at a longer sync period (derived, not measured)
                b, c = statistics.median(between), statistics.median(cost)
                d["ratio_daemon_derived"] = {str(h): b * h / (h + c) for h in (50, 100, 500)}
        result["devices"][device] = d
        name = env.get("gpu", device)
        line = (f"{device} ({name}): bare {d['bare']['median_tokens_per_s']:.0f} tokens/s; learner "
                f"{fmt(d['ratio_learner'])}x, lagged {fmt(d['ratio_lagged'])}x")
        if with_daemon:
            line += (f", daemon {fmt(d['ratio_daemon'])}x of bare (mean per run, 95% interval; daemon within 3% in "
                     f"{d['ratio_daemon']['runs_within_3pct']} of {dargs.repeats}); daemon between rounds "
                     f"{d['ratio_daemon_between_rounds']['median']:.3f}x, a round costs "
                     f"{d['round_cost_in_steps']['median'] or float('nan'):.1f} steps")
        else:
            line += (f" of bare (mean per run, 95% interval); within 3%: learner "
                     f"{d['ratio_learner']['runs_within_3pct']}, lagged {d['ratio_lagged']['runs_within_3pct']} "
                     f"of {dargs.repeats}")
        print(line, flush=True)
    result |= {"loadavg_before": load_before, "loadavg_after": os.getloadavg(),
               "minutes": (time.time() - started) / 60}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out.with_suffix(".json"), result)
    wrote = [out.with_suffix(".json")]
    if not args.no_plot:
        plot(result, out.with_suffix(".png"))
        wrote.append(out.with_suffix(".png"))
    print("wrote " + " and ".join(map(str, wrote)))
    return result


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        if args.worker:  # a child: anything but bad arguments leaves its traceback for the driver to show
            print(json.dumps(worker_pair(args)))
            return 0
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: children are ended on the way out
        run(args)
    except BadArgs as e:
        print(f"bench_device_overhead: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a child failed: what it said
        print(f"bench_device_overhead: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
