#!/usr/bin/env python3
"""Which outer optimizer, at which batch size: DiLoCo against ddp in one process, equal tokens, no network.

    python -m scripts.bench_outer [--steps 300] [--batch 8] [--configs ddp 40,0.7,0.9 40,1,0 ...]

Four learners (the daemons' ``Learner``, shards 0–3, the same seed) train side by side in this process, one
configuration after another, each from the same initial model:
- ``ddp``: every step the four gradients are averaged and every learner takes the same AdamW step (one step on a
  4× larger batch, as the ``ddp`` algorithm does over the network);
- ``H,LR,MU``: DiLoCo. Every H steps (and after the last step) the four pseudo-gradients Θ − θ are averaged and
  the outer optimizer (``NesterovOuter``: step size LR, Nesterov momentum MU; 1,0 is plain averaging) updates Θ,
  which every learner restarts from. The same functions the daemons use.
- ``H,LR,MU,H0xS0``: the same, with rounds every H0 steps during the first S0 steps (a synchronous warm start,
  as DiLoCo's runs start from a model pre-trained synchronously).

``--lr-schedule cosine`` decays every learner's inner learning rate after warm-up along a half cosine to 10% of
``--inner-lr`` at the last step (ddp's too); the default is the daemons' constant rate after warm-up.

Everything is deterministic: a configuration run twice gives the same loss, so differences between rows are the
configurations' (at one seed and one data order), not this machine's load. Reported: the held-out loss of Θ (ddp:
of the model) on the same held-out batches, and its ratio to ddp's in the same setting (steps, batch, model, inner
learning rate and schedule). Results are appended to docs/results/outer/bench_outer.json (a row with the same setting and
config is replaced) and plotted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus, load_corpus
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner
from scripts.bars import each
from scripts.benchkit import diloco
from scripts.results import pyplot, save_figure, write_result

LEARNERS = 4
EVAL_BATCHES = 32


def cosine_lr(base: float, warmup: int, step: int, total: int, floor: float = 0.1) -> float:
    """The inner learning rate at ``step`` (0-based) of ``total``: linear warm-up over ``warmup`` steps, then a half
    cosine from ``base`` down to ``floor``·``base`` at the last step."""
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


class CosineLearner(Learner):
    total_steps = 0  # the run's length, set on each learner

    def _lr(self) -> float:
        return cosine_lr(self.run.inner_lr, self.run.warmup_steps, self.step, self.total_steps)


def learners(run: RunConfig, batch: int, schedule: str = "constant",
             steps: int = 0) -> tuple[list[Learner], list[torch.Tensor]]:
    tokens, _ = load_corpus(run.data)
    corpus = Corpus(tokens, get_model_config(run.model).seq_len, run.num_shards)
    device = resolve_device("cpu")
    ls = [(CosineLearner if schedule == "cosine" else Learner)(run, device, corpus, s, batch) for s in range(LEARNERS)]
    for learner in ls:
        if isinstance(learner, CosineLearner):
            learner.total_steps = steps
    return ls, corpus.held_out(EVAL_BATCHES, batch)


def train_ddp(run: RunConfig, steps: int, batch: int, schedule: str = "constant") -> float:
    ls, held_out = learners(run, batch, schedule, steps)
    for _ in range(steps):
        grads = []
        for learner in ls:
            learner.backward()
            grads.append(learner.flat_grads())
        mean = torch.stack(grads).mean(0)
        for learner in ls:
            learner.load_flat_grads(mean)
            learner.apply_step()
    return ls[0].evaluate(held_out)


def train_diloco(run: RunConfig, steps: int, batch: int, sync_every: int, lr: float, momentum: float,
                 warm: tuple[int, int] = (0, 0), schedule: str = "constant") -> float:
    ls, held_out = learners(run, batch, schedule, steps)
    diloco(ls, steps, sync_every, lr, momentum, warm)
    return ls[0].evaluate(held_out)


def setting(row: dict) -> tuple:
    """What a row is compared within: ddp's row with the same setting is its reference."""
    return row["steps"], row["batch"], row["model"], row["inner_lr"], row.get("lr_schedule", "constant")


def parse_config(text: str) -> dict:
    if text == "ddp":
        return {"config": "ddp"}
    try:
        h, lr, mu, *warm = text.split(",")
        h0, s0 = (int(x) for x in warm[0].split("x")) if warm else (0, 0)
        if len(warm) > 1 or int(h) < 1 or (warm and (h0 < 1 or s0 < 0)):
            raise ValueError
        return {"config": text, "sync_every": int(h), "outer_lr": float(lr), "outer_momentum": float(mu),
                "warm": [h0, s0]}
    except ValueError:
        raise SystemExit(f"bad config {text!r}: use ddp, H,LR,MU or H,LR,MU,H0xS0 (e.g. 40,0.7,0.9 or 40,1,0,2x60)"
                         ) from None


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()

    groups = sorted({setting(r) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.2), squeeze=False)
    for ax, group in zip(axes[0], groups):
        steps, batch, model, inner_lr, schedule = group
        sel = [r for r in rows if setting(r) == group]
        sel.sort(key=lambda r: (r["config"] != "ddp", r["config"]))
        ax.bar([r["config"] for r in sel], [r["ratio_to_ddp"] or 0 for r in sel], color="tab:blue")
        ax.axhline(1.01, color="tab:red", lw=1, ls="--", label="1.01× ddp")
        ax.set_ylim(0.95, max(1.2, max((r["ratio_to_ddp"] or 0) for r in sel) + 0.02))
        ax.set_title(f"batch {batch}, {steps} steps, lr {inner_lr:g} {schedule}", fontsize=9)
        ax.set_ylabel("held-out loss / ddp")
        ax.tick_params(axis="x", rotation=60, labelsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("DiLoCo (H, outer lr, momentum) vs ddp: 4 learners, equal tokens")
    fig.tight_layout()
    save_figure(fig, out / "bench_outer.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="inner steps per learner")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step per learner (ddp: 4x per step)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--inner-lr", type=float, default=RunConfig().inner_lr)
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["ddp", "40,0.7,0.9", "40,1,0"])
    parser.add_argument("--out", default="docs/results/outer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    path = out / "bench_outer.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for text in each(args.configs, "configurations"):
        cfg = parse_config(text)
        run = RunConfig(model=args.model, inner_lr=args.inner_lr, sync_every=cfg.get("sync_every", 50))
        t0 = time.monotonic()
        if cfg["config"] == "ddp":
            loss = train_ddp(run, args.steps, args.batch, args.lr_schedule)
        else:
            loss = train_diloco(run, args.steps, args.batch, cfg["sync_every"], cfg["outer_lr"], cfg["outer_momentum"],
                                tuple(cfg["warm"]), args.lr_schedule)
        row = {**cfg, "steps": args.steps, "batch": args.batch, "model": args.model, "inner_lr": args.inner_lr,
               "lr_schedule": args.lr_schedule,
               "held_out_loss": loss, "seconds": round(time.monotonic() - t0, 1),
               "command": "python -m scripts.bench_outer " + " ".join(sys.argv[1:])}
        rows = [r for r in rows if (setting(r), r["config"]) != (setting(row), row["config"])] + [row]
        print(f"batch {args.batch} steps {args.steps} {text:14s} held-out loss {loss:.4f} ({row['seconds']:.0f} s)",
              flush=True)
    for r in rows:
        ref = next((x["held_out_loss"] for x in rows if x["config"] == "ddp" and setting(x) == setting(r)), None)
        r["ratio_to_ddp"] = r["held_out_loss"] / ref if ref else None
    out.mkdir(parents=True, exist_ok=True)
    write_result(path, {"learners": LEARNERS, "eval_batches": EVAL_BATCHES, "rows": rows})
    plot(rows, out)
    for r in sorted(rows, key=lambda r: (setting(r), r["config"])):
        ratio = f"{r['ratio_to_ddp']:.3f}x" if r["ratio_to_ddp"] else "-"
        print(f"  batch {r['batch']:3d} steps {r['steps']:5d} lr {r['inner_lr']:g} {r.get('lr_schedule', 'constant'):8s} "
              f"{r['config']:14s} {r['held_out_loss']:.4f}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
