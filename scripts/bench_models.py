#!/usr/bin/env python3
"""A Llama-style swarm and a GPT swarm of equal parameter count on the same prepared BPE data: held-out loss.

    python -m scripts.bench_models [--seeds 0 1 2] [--steps 400] [--vocab 1024] [--sync-every 20]

The data: the built-in corpus's text (the standard library files ``models/data.py`` lists) prepared once with
``atoll data prepare``'s own code (a byte-level BPE of ``--vocab`` ids, 5% of the documents in the manifest's
held-out split), cached under ``runs/bench_models/`` (never committed) and reused while its settings match.

The models: the built-in GPT (tied embeddings, GELU MLP of 4·d) at ``--d-model``/``--layers``/``--heads``, and a
Llama-style model (SwiGLU, grouped-query attention, untied head) of the same width, depth and heads whose SwiGLU
width is chosen so that the two totals match (``matched_llama``: its untied head costs vocab·d, paid for with a
narrower MLP). Both counts are printed and must agree within ``--tolerance``.

The swarm: four of the daemons' own ``Learner``s in this process doing DiLoCo with the daemons' own functions
(``scripts/bench_outer.py``'s ``diloco``: ``pseudo_gradient``, ``weighted_mean``, ``NesterovOuter``, ``flatten``,
``copy_into``), a round every ``--sync-every`` inner steps and after the last, the outer step ``--outer-lr`` /
``--outer-momentum`` (default 1/0, plain averaging: it did better than Nesterov 0.7/0.9 at this scale,
docs/results.md "The outer step at this scale"). Per seed both models get the same initial-model seed, the same
shards (learner i of seed s reads shard 4s+i of 16: the seed sets the data order) and the same number of steps.

Everything is deterministic (a seed run twice gives the same losses), so the comparison is at equal steps and
tokens and does not depend on this machine's load. Reported per seed: the held-out loss of Θ for each model on the
same 32 batches of the prepared held-out split (documents neither model trained on), and llama/gpt; over seeds:
the mean ratio with a 95% Student-t interval. Also the loss on the ``Corpus``'s own held-out blocks (what a daemon
reports) and a curve of Θ's held-out loss (first 8 batches) after every round. Writes
``<out>/bench_models.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch


from scripts.bars import each
from scripts.benchkit import diloco  # the same DiLoCo loop as the outer-step benchmark
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

from atoll.models.data import Corpus, _builtin_files, load_corpus
from atoll.models.dataset import PreparedDataset, is_prepared
from atoll.models.gpt import GPT, GPTConfig
from atoll.models.llama import Llama, LlamaConfig
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner

LEARNERS = 4
NUM_SHARDS = 16
EVAL_BATCHES = 32
CURVE_BATCHES = 8
HELD_OUT_FRACTION = 0.05


def matched_llama(gpt: GPTConfig, n_kv_heads: int, multiple: int = 8, tie_embeddings: bool = False) -> LlamaConfig:
    """The Llama-style config of ``gpt``'s vocabulary, sequence length, width, depth and heads (``n_kv_heads``
    key/value heads) whose SwiGLU width (a multiple of ``multiple``) brings its parameter count closest to the
    GPT's. ``ValueError`` if even the narrowest MLP has more parameters than the GPT."""
    base = LlamaConfig(vocab_size=gpt.vocab_size, seq_len=gpt.seq_len, d_model=gpt.d_model, n_layers=gpt.n_layers,
                       n_heads=gpt.n_heads, n_kv_heads=n_kv_heads, ffn_dim=multiple, tie_embeddings=tie_embeddings)
    per_unit = 3 * gpt.d_model * gpt.n_layers * multiple  # parameters per ``multiple`` of SwiGLU width
    extra = gpt.num_params - base.num_params
    if extra < 0:
        raise ValueError(f"a Llama of this shape has {base.num_params} parameters at ffn_dim {multiple}, more than "
                         f"the GPT's {gpt.num_params}")
    units = max(1, 1 + round(extra / per_unit))
    best = min((replace(base, ffn_dim=multiple * u) for u in (units - 1, units, units + 1) if u >= 1),
               key=lambda c: abs(c.num_params - gpt.num_params))
    return best


def embedding_params(cfg: GPTConfig | LlamaConfig) -> int:
    """Parameters of the token embedding and the output head (once when tied)."""
    tied = isinstance(cfg, GPTConfig) or cfg.tie_embeddings
    return cfg.vocab_size * cfg.d_model * (1 if tied else 2)


def prepare_data(vocab: int, root: Path) -> Path:
    """The built-in corpus's files prepared with a BPE of ``vocab`` ids, once; reused while the settings match."""
    from atoll.models.prepare import PrepareOptions, prepare

    files = _builtin_files()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-bpe{vocab}-h{HELD_OUT_FRACTION:g}-{len(files)}files"
    out = root / tag
    if is_prepared(out):
        return out
    t0 = time.monotonic()
    prepare([str(p) for p in files], str(out),
            PrepareOptions(vocab_size=vocab, held_out=HELD_OUT_FRACTION, progress=False, force=True))
    print(f"prepared {out} in {time.monotonic() - t0:.1f} s", flush=True)
    return out


def held_out_batches(tokens: np.ndarray, seq_len: int, num_batches: int, batch: int) -> list[torch.Tensor]:
    """``num_batches`` fixed batches of windows spread evenly (without overlap) over ``tokens``."""
    window = seq_len + 1
    n = tokens.size // window
    if n < num_batches * batch:
        raise ValueError(f"held-out split too small: {n} windows for {num_batches}x{batch}")
    rows = np.linspace(0, n - 1, num_batches * batch).astype(np.int64).reshape(num_batches, batch)
    return [torch.from_numpy(tokens[r[:, None] * window + np.arange(window)[None, :]].astype(np.int64))
            for r in rows]


def build(cfg: GPTConfig | LlamaConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)


def train(cfg: GPTConfig | LlamaConfig, corpus: Corpus, eval_sets: dict[str, list[torch.Tensor]], seed: int,
          steps: int, batch: int, sync_every: int, outer_lr: float, inner_lr: float) -> dict:
    """One swarm: four learners from the same Θ₀ (``seed``), shards 4·seed+i, DiLoCo; losses of the final Θ.

    Run round by round with ``bench_outer.diloco`` (each call: ``sync_every`` steps, then its closing round) so
    that Θ is evaluated after every round; the same as one call because the outer momentum is 0 (no buffer
    carries over), which is why this benchmark has no momentum option."""
    run = RunConfig(model="bench", seed=seed, inner_lr=inner_lr, sync_every=sync_every, num_shards=NUM_SHARDS)
    device = resolve_device("cpu")
    init = build(cfg, seed)
    state = init.state_dict()
    ls = []
    for i in range(LEARNERS):
        model = build(cfg, seed)
        model.load_state_dict(state)
        ls.append(Learner(run, device, corpus, (LEARNERS * seed + i) % NUM_SHARDS, batch, model=model))
    curve: list[list[float]] = []
    curve_set = eval_sets["prepared"][:CURVE_BATCHES]
    t0 = time.monotonic()
    done = 0
    while done < steps:  # rounds of ``sync_every`` steps; diloco's last round closes each chunk
        chunk = min(sync_every, steps - done)
        diloco(ls, chunk, sync_every, outer_lr, 0.0)  # momentum 0: no outer state carries from round to round
        done += chunk
        curve.append([done, ls[0].evaluate(curve_set)])
    seconds = time.monotonic() - t0
    return {"held_out_loss": ls[0].evaluate(eval_sets["prepared"]),
            "corpus_held_out_loss": ls[0].evaluate(eval_sets["corpus"]),
            "curve": curve, "seconds": round(seconds, 1)}


def plot(result: dict, out: Path) -> None:
    plt = pyplot()

    seeds = result["per_seed"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"gpt": "tab:blue", "llama": "tab:orange"}
    for r in seeds:
        for name in ("gpt", "llama"):
            xs, ys = zip(*r[name]["curve"])
            ax1.plot(xs, ys, color=colors[name], alpha=0.8, lw=1.2, marker="o", markersize=2.5,  # an evaluation
                     label=f"{name}" if r is seeds[0] else None)
    ax1.set_xlabel("inner steps per learner")
    ax1.set_ylabel(f"held-out loss of Θ (first {CURVE_BATCHES} batches)")
    ax1.set_title("Θ after each round, every seed")
    ax1.legend()
    lo = min(min(x[1] for x in r[n]["curve"]) for r in seeds for n in ("gpt", "llama"))
    ax1.set_ylim(lo - 0.1, lo + 2.0)
    width = 0.38
    idx = np.arange(len(seeds))
    ax2.bar(idx - width / 2, [r["gpt"]["held_out_loss"] for r in seeds], width, color=colors["gpt"],
            label=f"gpt ({result['models']['gpt']['params']:,} params)")
    ax2.bar(idx + width / 2, [r["llama"]["held_out_loss"] for r in seeds], width, color=colors["llama"],
            label=f"llama ({result['models']['llama']['params']:,} params)")
    vals = [r[n]["held_out_loss"] for r in seeds for n in ("gpt", "llama")]
    for i, r in enumerate(seeds):
        ax2.text(i, max(r["gpt"]["held_out_loss"], r["llama"]["held_out_loss"]) + 0.03 * max(vals),
                 f"{r['ratio']:.3f}×", ha="center", fontsize=9)
    ax2.set_ylim(0, max(vals) * 1.25)  # bars start at zero: a cut axis would make the gap look larger than it is
    ax2.set_xticks(idx, [f"seed {r['seed']}" for r in seeds])
    ax2.set_ylabel(f"held-out loss of Θ ({EVAL_BATCHES} batches)")
    s = result["summary"]["ratio"]
    ax2.set_title(f"final; llama/gpt {s['mean']:.3f} ± {s['ci95'] or 0:.3f} (95%)", fontsize=10)
    ax2.legend(fontsize=8, loc="upper center", ncol=2)
    st = result["settings"]
    fig.suptitle(f"GPT vs Llama-style, equal parameters, BPE {st['vocab']}: {LEARNERS} learners DiLoCo "
                 f"H={st['sync_every']}, {st['steps']} steps, batch {st['batch']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, out / "bench_models.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400, help="inner steps per learner")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step per learner")
    parser.add_argument("--vocab", type=int, default=1024, help="ids of the trained BPE")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="the Llama's key/value heads")
    parser.add_argument("--sync-every", type=int, default=20, metavar="H")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--inner-lr", type=float, default=RunConfig().inner_lr)
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest relative parameter-count gap")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-root", default="runs/bench_models")
    parser.add_argument("--out", default="docs/results/models")
    parser.add_argument("--replot", action="store_true", help="only redraw bench_models.png from the JSON in --out")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((Path(args.out) / "bench_models.json").read_text()), Path(args.out))
        return 0
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()

    gpt = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)
    llama = matched_llama(gpt, args.kv_heads)
    for built, cfg in ((build(gpt, 0), gpt), (build(llama, 0), llama)):  # the formulas checked against the modules
        assert sum(p.numel() for p in built.parameters()) == cfg.num_params, cfg
    gap = llama.num_params / gpt.num_params - 1
    models = {name: {"config": {"class": type(cfg).__name__, **asdict(cfg)}, "params": cfg.num_params,
                     "embedding_params": embedding_params(cfg),
                     "embedding_share": round(embedding_params(cfg) / cfg.num_params, 4),
                     "non_embedding_params": cfg.num_params - embedding_params(cfg)}
              for name, cfg in (("gpt", gpt), ("llama", llama))}
    for name, m in models.items():
        print(f"{name:5s} {m['params']:,} parameters ({m['embedding_params']:,} embedding+head, "
              f"{m['embedding_share']:.0%}; {m['non_embedding_params']:,} other)", flush=True)
    print(f"llama/gpt parameters {1 + gap:.4f} (SwiGLU width {llama.hidden})", flush=True)
    if abs(gap) > args.tolerance:
        raise SystemExit(f"parameter counts differ by {gap:+.1%}, more than {args.tolerance:.0%}")

    data = prepare_data(args.vocab, Path(args.data_root))
    tokens, vocab = load_corpus(str(data))
    if vocab > args.vocab:
        raise SystemExit(f"the prepared vocabulary {vocab} exceeds the models' {args.vocab}")
    corpus = Corpus(tokens, args.seq_len, NUM_SHARDS)
    eval_sets = {"prepared": held_out_batches(PreparedDataset(data).tokens("held_out"), args.seq_len,
                                              EVAL_BATCHES, args.batch),
                 "corpus": corpus.held_out(EVAL_BATCHES, args.batch)}
    manifest = PreparedDataset(data).manifest
    print(f"data {data}: {manifest.tokens['train']:,} training tokens, {manifest.tokens['held_out']:,} held out "
          f"({manifest.documents['held_out']} documents)", flush=True)

    per_seed = []
    for seed in each(args.seeds, "seeds"):
        row = {"seed": seed, "shards": [(LEARNERS * seed + i) % NUM_SHARDS for i in range(LEARNERS)]}
        for name, cfg in (("gpt", gpt), ("llama", llama)):
            row[name] = train(cfg, corpus, eval_sets, seed, args.steps, args.batch, args.sync_every, args.outer_lr,
                              args.inner_lr)
            print(f"seed {seed} {name:5s} held-out {row[name]['held_out_loss']:.4f} "
                  f"(corpus blocks {row[name]['corpus_held_out_loss']:.4f}) {row[name]['seconds']:.0f} s", flush=True)
        row["ratio"] = row["llama"]["held_out_loss"] / row["gpt"]["held_out_loss"]
        row["corpus_ratio"] = row["llama"]["corpus_held_out_loss"] / row["gpt"]["corpus_held_out_loss"]
        print(f"seed {seed} llama/gpt {row['ratio']:.4f} (corpus blocks {row['corpus_ratio']:.4f})", flush=True)
        per_seed.append(row)

    summary = {"gpt": interval([r["gpt"]["held_out_loss"] for r in per_seed]),
               "llama": interval([r["llama"]["held_out_loss"] for r in per_seed]),
               "ratio": interval([r["ratio"] for r in per_seed]),
               "corpus_ratio": interval([r["corpus_ratio"] for r in per_seed]),
               "difference": interval([r["llama"]["held_out_loss"] - r["gpt"]["held_out_loss"] for r in per_seed])}
    settings = {"learners": LEARNERS, "num_shards": NUM_SHARDS, "steps": args.steps, "batch": args.batch,
                "tokens_per_learner": args.steps * args.batch * args.seq_len, "vocab": args.vocab,
                "prepared_vocab": vocab, "seq_len": args.seq_len, "sync_every": args.sync_every,
                "outer_lr": args.outer_lr, "outer_momentum": 0.0, "inner_lr": args.inner_lr,
                "warmup_steps": RunConfig().warmup_steps, "weight_decay": RunConfig().weight_decay,
                "eval_batches": EVAL_BATCHES, "curve_batches": CURVE_BATCHES,
                "held_out_fraction": HELD_OUT_FRACTION, "seeds": args.seeds, "threads": args.threads,
                "data": {"input_files": len(_builtin_files()),
                         "tokens": manifest.tokens, "documents": manifest.documents,
                         "tokenizer_sha256": manifest.tokenizer_sha256}}
    result = {"settings": settings, "models": models, "param_ratio": 1 + gap, "per_seed": per_seed,
              "summary": summary, "seconds": round(time.monotonic() - t_start, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_models.json", result)
    plot(result, out)
    print(f"gpt   {fmt(summary['gpt'])}\nllama {fmt(summary['llama'])}\nllama/gpt {fmt(summary['ratio'])} "
          f"(corpus blocks {fmt(summary['corpus_ratio'])}); {result['seconds']:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
