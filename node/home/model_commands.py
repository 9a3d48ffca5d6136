"""``atoll export``, ``atoll sample`` and ``atoll eval``: the commands that take a run's model home
(``node/home/export.py``, ``node/home/evaluate.py``). Bad input is a ``ConfigError``: one line, exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ..checks import ConfigError

COMMANDS = ("export", "sample", "eval")


def add_parsers(sub: argparse._SubParsersAction, run_id: str) -> None:
    p = sub.add_parser("export", help="write the run's global model (every fragment's replica) from a checkpoint "
                                      "directory or a live run as files other tools load (docs/export.md)")
    p.add_argument("checkpoint_dir", nargs="?", metavar="CHECKPOINT_DIR",
                   help="a daemon's --checkpoint-dir (its newest intact checkpoint); or read a live run with "
                        "--initial-peers")
    p.add_argument("--out", metavar="DIR", required=True, help="the export directory to write (new or empty)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' dtype (default fp32)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="a live run: daemons of it (the newest "
                                                                       "vouched replica is downloaded)")
    p.add_argument("--run-id", default=run_id)
    p.add_argument("--join-token", metavar="PATH", help="a live private run: a join token of its own (`atoll "
                                                        "token`; not one a running daemon uses)")
    p.add_argument("--run-key", metavar="PATH", help="a live private run: the run key, instead of a token")
    _model_args(p)
    for name, what in (("sample", "write text with a run's model, from a checkpoint directory or an export"),
                       ("eval", "held-out loss and perplexity of a run's model on a dataset")):
        q = sub.add_parser(name, help=what)
        q.add_argument("path", metavar="PATH", help="a checkpoint directory or an export directory")
        q.add_argument("--local", action="store_true", help="a checkpoint's own θ (what the daemon's held-out "
                                                            "figure measures) instead of the global model Θ")
        _model_args(q)
        if name == "sample":
            q.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
            q.add_argument("--max-tokens", type=int, default=200, metavar="N", help="tokens to write (default 200)")
            q.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest token "
                                                                          "(default 0.8)")
            q.add_argument("--top-k", type=int, default=40, metavar="K", help="draw from the K likeliest tokens; 0: "
                                                                              "from all (default 40)")
            q.add_argument("--seed", type=int, default=0, help="the same seed writes the same text (default 0)")
        else:
            from ..config import NodeConfig

            q.add_argument("--batches", type=int, default=NodeConfig().eval_batches, metavar="N",
                           help="held-out batches, chosen as a daemon chooses them; 0: the whole held-out split "
                                f"(default {NodeConfig().eval_batches}, a daemon's --eval-batches)")
            q.add_argument("--batch-size", type=int, default=NodeConfig().batch_size, metavar="N",
                           help=f"sequences per batch (default {NodeConfig().batch_size}, a daemon's --batch-size)")
            q.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", metavar="PATH", help="the run's data as `atoll start --data` takes it (eval: the data "
                                                  "to evaluate on; export and sample: where the run's prepared "
                                                  "dataset and its tokenizer are)")
    p.add_argument("--model", metavar="NAME", help="the run's model where its record does not name it "
                                                   "(atoll.Island's own model: package.module:factory)")


def run(args: argparse.Namespace) -> int:
    from .export import ExportError

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "sample":
            return _sample(args)
        return _eval(args)
    except ExportError as e:
        raise ConfigError(str(e)) from None


def _export(args: argparse.Namespace) -> int:
    from . import export

    if (args.checkpoint_dir is None) == (args.initial_peers is None):
        raise ConfigError("export: name a CHECKPOINT_DIR, or a live run with --initial-peers (not both)")
    started = time.monotonic()
    if args.checkpoint_dir is not None:
        if args.join_token or args.run_key:
            raise ConfigError("export: --join-token and --run-key are for a live run (--initial-peers)")
        g = export.from_checkpoint(args.checkpoint_dir, model=args.model)
    else:
        import dataclasses

        from ..config import NodeConfig

        cfg = dataclasses.replace(NodeConfig(), run_id=args.run_id, initial_peers=tuple(args.initial_peers),
                                  join_token=args.join_token, run_key=args.run_key)
        cfg.validate()
        g = export.from_live(cfg, model=args.model)
    tokenizer = export.write(g, args.out, args.dtype, args.data)
    identities = ", ".join(f"f{p} v{v} ({d})" for p, (v, _, d) in enumerate(g.identities))
    print(f"exported model {g.run.model!r} of run {g.run_id!r} from {g.source}: {identities}; {args.dtype}, "
          f"tokenizer {tokenizer[:16]} -> {args.out} in {time.monotonic() - started:.1f} s")
    return 0


def _load(args: argparse.Namespace):
    from . import export

    return export.load(args.path, model=args.model, local=args.local)


def _sample(args: argparse.Namespace) -> int:
    from .evaluate import sample, tokenizer_for

    if args.max_tokens < 1:
        raise ConfigError(f"max_tokens: must be at least 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise ConfigError(f"temperature: must be 0 or more, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"top_k: must be 0 or more, got {args.top_k}")
    g = _load(args)
    tok = tokenizer_for(g, args.data)
    sys.stdout.write(args.prompt)
    sample(g, tok, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed,
           on_text=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    sys.stdout.write("\n")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from atoll.models.registry import shape_of

    from ..run_config import LOCAL_DATA
    from .evaluate import evaluate, held_out_batches, tokenizer_for

    if args.batch_size < 1 or args.batches < 0:
        raise ConfigError("eval: --batch-size must be at least 1 and --batches 0 or more")
    g = _load(args)
    data = args.data or (g.run.data if g.run.data != LOCAL_DATA else None)
    if data is None:
        raise ConfigError("eval: the run trained on data of its own: pass --data")
    shape = shape_of(g.model)
    batches = held_out_batches(data, shape.seq_len, shape.vocab_size, args.batches, args.batch_size,
                               g.run.tokenizer)
    tok = tokenizer_for(g, data if data != "builtin" else None)
    result = evaluate(g, tok, batches, f"evaluating {len(batches)} batches")
    if args.json:
        print(json.dumps({**result.as_dict(), "model": g.run.model, "source": g.source, "data": data,
                          "versions": [v for v, _, _ in g.identities]}))
    else:
        print(f"{g.source}, {g.versions()}, on {data}: held-out loss {result.loss:.4f} per token (perplexity "
              f"{result.perplexity:.2f}), {result.loss_per_byte:.4f} per byte ({result.bits_per_byte:.4f} bits), "
              f"{result.tokens} tokens in {result.batches} batches")
    return 0
