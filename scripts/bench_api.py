#!/usr/bin/env python3
"""What ``atoll.Island`` costs a user's own loop: tokens/s of the same loop bare and inside an island, side by side.

    python -m scripts.bench_api [--model tiny] [--steps 300] [--repeats 3] [--block 10]
    PJRT_DEVICE=CPU XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        PYTHONPATH=build/xla-path ~/.cache/atoll/venv-xla/bin/python -m scripts.bench_api --device xla \
        --out docs/results/api/bench_api_xla        # torch_xla's CPU runtime, with the xla venv of `make test-xla`
    python -m scripts.bench_api --device cuda --precision bf16 --model llama-150m --batch 16 --steps 200 \
        --out docs/results/api/bench_api_cuda       # a GPU: the ~150M Llama preset under bf16 autocast

Two copies of one user loop (the same model preset and seed, AdamW, clipping, the built-in corpus) run in this
process on one torch thread, alternating blocks of ``--block`` steps in AB BA order, so that whatever else runs
on the machine slows both alike:

- bare: the loop alone;
- island: the same loop whose model and optimizer an ``atoll.Island`` wraps: a new open run of one member with
  every default (decoupled, H=50, 4 fragments, int4 with error feedback), a checkpoint directory (a checkpoint
  after every last-fragment merge), the DHT and the syncer's thread in this process, the held-out loss measured
  within the default 1% of wall time.

On cuda both loops end each step with ``torch.cuda.synchronize()``; with ``--precision bf16`` both run forward
and loss under ``torch.autocast(bfloat16)`` (the weights and AdamW state stay fp32). On xla both loops end each step with ``torch_xla.sync()``, as an xla user's loop does, and use AdamW with
``capturable=True`` (a host-side step count would recompile every step); the island cuts the graph at each step
boundary itself, so what it does there is never traced into the user's step.

Each repetition builds both from seed ``repeat`` and times ``--steps`` steps of each after ``--warmup`` steps.
The ratio island/bare is taken within each repetition; reported: per repetition, the mean with a 95% interval
(Student's t) and the median. Writes docs/results/api/bench_api.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

import atoll
from atoll.models.data import Corpus, load_corpus
from atoll.models.registry import build_model

ROOT = Path(__file__).resolve().parent.parent


class Loop:
    """One user loop: model, AdamW, its data position; ``run(n)`` trains n steps and returns the seconds."""

    def __init__(self, model_name: str, seed: int, corpus_tokens, batch: int, shard: int, device: str,
                 precision: str = "fp32") -> None:
        model, shape = build_model(model_name, seed)
        if device == "xla":
            import torch_xla

            self.device, self.sync = torch_xla.device(), torch_xla.sync
        elif device == "cuda":
            self.device, self.sync = torch.device("cuda"), torch.cuda.synchronize
        else:
            self.device, self.sync = torch.device("cpu"), lambda: None
        self.bf16 = precision == "bf16"
        self.model = model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                           capturable=device != "cpu")
        self.corpus = Corpus(corpus_tokens, shape.seq_len, 16)
        self.batch, self.shard, self.position = batch, shard, 0
        self.tokens_per_step = batch * shape.seq_len

    def run(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            b = self.corpus.batch_at(self.shard, self.position, self.batch).to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.model(b[:, :-1].contiguous(), b[:, 1:].contiguous())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()  # inside an island: the step boundary
            self.optimizer.zero_grad(set_to_none=True)
            self.sync()
            self.position += self.batch
        float(loss.detach())  # the last step has finished (xla runs a step when the graph is cut, asynchronously)
        return time.perf_counter() - t0


def repetition(args: argparse.Namespace, seed: int, tokens) -> dict:
    bare = Loop(args.model, seed, tokens, args.batch, 0, args.device, args.precision)
    inside = Loop(args.model, seed, tokens, args.batch, 0, args.device, args.precision)
    with tempfile.TemporaryDirectory() as ckpt:
        held_out = inside.corpus.held_out(4, args.batch)

        def evaluate(m: torch.nn.Module) -> float:
            return sum(float(m(b[:, :-1].to(inside.device), b[:, 1:].to(inside.device))) for b in held_out) / len(held_out)

        island = atoll.Island(inside.model, inside.optimizer, evaluate=evaluate,
                              tokens_per_step=inside.tokens_per_step, open=True, checkpoint_dir=ckpt,
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"], log_level="WARNING",
                              run_id=f"bench-api-{seed}")
        with island:
            bare.run(args.warmup)
            inside.run(args.warmup)
            seconds = {"bare": 0.0, "island": 0.0}
            for block in range(args.steps // args.block):
                order = ("bare", "island") if block % 2 == 0 else ("island", "bare")
                for kind in order:
                    seconds[kind] += (bare if kind == "bare" else inside).run(args.block)
            rounds = island.version
        steps = (args.steps // args.block) * args.block
    rate = {k: steps * bare.tokens_per_step / s for k, s in seconds.items()}
    return {"seed": seed, "steps": steps, "tokens_per_s": rate, "ratio": rate["island"] / rate["bare"],
            "rounds_merged": rounds}


def plot(results: list[dict], summary: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ratios = [r["ratio"] for r in results]
    ax.bar(range(len(ratios)), ratios, color="tab:blue")
    ax.axhline(0.97, color="tab:red", linestyle="--", label="goal 0.97")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), [f"seed {r['seed']}" for r in results])
    ax.set_ylim(min(0.85, min(ratios) - 0.02), max(1.05, max(ratios) + 0.02))
    ax.set_ylabel("tokens/s, island / bare loop")
    ax.set_title(f"atoll.Island around a user's loop ({summary['model']}, {summary['device']}, "
                 f"{summary['precision']}): "
                 f"{fmt(summary['ratio'])}",
                 fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=("cpu", "cuda", "xla"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "api" / "bench_api"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokens, _ = load_corpus("builtin")
    results = []
    for seed in each(range(args.repeats), "repeats"):
        r = repetition(args, seed, tokens)
        results.append(r)
        print(f"seed {seed}: bare {r['tokens_per_s']['bare']:.0f} tok/s, island {r['tokens_per_s']['island']:.0f} "
              f"tok/s, ratio {r['ratio']:.3f}, {r['rounds_merged']} fragment rounds merged", flush=True)
    ratios = [r["ratio"] for r in results]
    summary = {"model": args.model, "batch": args.batch, "steps": args.steps, "block": args.block,
               "device": args.device, "precision": args.precision, "threads": 1, "ratio": interval(ratios), "ratio_median": statistics.median(ratios),
               "goal": 0.97, "repeats_meeting_goal": sum(r >= 0.97 for r in ratios)}
    print(f"island/bare tokens/s: {fmt(summary['ratio'])}, median {summary['ratio_median']:.3f}; "
          f"goal 0.97 met in {summary['repeats_meeting_goal']} of {len(ratios)}")
    out = Path(args.out)
    write_result(out.with_suffix(".json"), {"summary": summary, "runs": results})
    plot(results, summary, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
