#!/usr/bin/env python3
"""An in-process swarm: M of atoll's own learners in one process, their outer rounds computed with the daemon's
outer code, fragments and codec, each round landing a set number of inner steps after its snapshot.

It isolates the algorithm from the network: no DHT, no matchmaking, no timing noise. What it keeps of the daemon:

- ``node.learner.Learner`` (the daemon's inner loop, its AdamW, warm-up, autocast and data order), shard ``i`` of
  the corpus for learner ``i``;
- ``models.fragments.make_fragments`` (the daemon's split and staggered due steps) and one shared replica Θ_p
  per fragment, the same on every member, as in the daemon;
- the pseudo-gradient Δ = Θ_p − θ_p,snapshot, error feedback and the wire codec per member
  (``protocols.codecs``), the reducer's re-encoding of the merged value, radial-directional
  averaging on non-embedding fragments of ``decoupled`` (the daemon's defaults), and ``NesterovOuter``;
- the merge rules a learner can apply when a round lands ``delay`` steps after its snapshot:
  ``overwrite`` (θ_p ← Θ_p,new: the steps since the snapshot are lost), ``mix`` (θ_p ← α·θ_p + (1−α)·Θ_p,new) and
  ``delta`` (θ_p ← Θ_p,new + (θ_p,now − θ_p,snapshot): the steps since the snapshot are carried into the next
  contribution).

Configurations (``Config.kind``): ``ddp`` (one learner whose step accumulates M micro-batches: the mean gradient
of M members, the same tokens per step as the swarm), ``diloco`` (one fragment, rounds land at once) and
``decoupled`` (P fragments, rounds land ``delay`` steps late). Every configuration trains the same number of
inner steps per learner, so they compare at equal tokens. The held-out loss is the global model's (Θ for the
swarms, θ for ddp), on fixed batches of the corpus's held-out split.

    python -m scripts.inproc_swarm --model nano --steps 200 --sync-every 20 --delay 5   # a CPU run of minutes

``device_check.py`` runs it on a GPU at ≥ 100M parameters; ``run_configs`` is the entry point for other scripts.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from scripts.results import write_result

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("ddp", "diloco", "decoupled")
SWARM_COST = 1.5  # a swarm's step time against ddp's, with its rounds (snapshots, codec) and model copies
MERGES = ("overwrite", "mix", "delta")


@dataclass(frozen=True)
class Config:
    """One configuration of the swarm. ``delay``: steps from a round's snapshot to its landing (decoupled; a round
    still in flight when its fragment falls due again skips that round, as a daemon does, so ``delay`` ≥ H means
    fewer rounds, each carrying more work); ``carry_max``: the delta rule's bound, in steps since the snapshot
    (beyond it the work is dropped, as overwriting does; 0: no bound);
    ``outer_lr``/``outer_momentum``/``outer_period``: Nesterov (1.0/0.0 is plain averaging; a period N > 1 is
    Delayed Nesterov); ``codec``: the wire codec with error
    feedback (``none`` for exact fp32)."""

    kind: str = "decoupled"
    merge: str = "delta"
    alpha: float = 0.5
    delay: int = 0
    carry_max: int = 0
    fragments: int = 4
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_period: int = 1
    codec: str = "int4"
    rda: bool = True

    @property
    def name(self) -> str:
        if self.kind == "ddp":
            return "ddp"
        if self.kind == "diloco":
            return "diloco"
        merge = f"mix{self.alpha:g}" if self.merge == "mix" else self.merge
        bound = f"-max{self.carry_max}" if self.merge == "delta" and self.carry_max else ""
        return f"decoupled-{merge}{bound}-k{self.delay}"


@dataclass
class Counters:
    """Tokens of one learner (one island's step for ddp): trained, carried by the delta rule into a later
    contribution, and lost by overwriting (or by the share a mix drops, counted whole)."""

    trained: int = 0
    carried: int = 0
    lost: int = 0
    skipped: int = 0  # due rounds not started because the fragment's previous round was still in flight


@dataclass
class _Round:
    """A round in flight: the new replica value and every member's snapshot, landing at ``land_step``."""

    land_step: int
    snap_step: int
    value: torch.Tensor
    snaps: list[torch.Tensor]


@dataclass
class Result:
    config: dict
    steps: int
    tokens_per_learner: int
    held_out: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    seconds: float = 0.0
    parameters: int = 0


class Swarm:
    """M learners and the shared replicas of their fragments (see the module's docstring)."""

    def __init__(self, cfg: Config, run, device, corpus, members: int, batch_size: int, sync_every: int,
                 precision: str | None = None, model0: torch.nn.Module | None = None) -> None:
        from atoll.models.fragments import make_fragments
        from atoll.models.registry import embedding_of
        from atoll.node.island.learner import Learner
        from atoll.protocols.error_feedback import ErrorFeedback

        if cfg.kind not in KINDS or cfg.merge not in MERGES:
            raise ValueError(f"unknown configuration {cfg}")
        if cfg.kind == "decoupled" and cfg.delay < 0:
            raise ValueError(f"delay must be ≥ 0, not {cfg.delay}")
        self.cfg, self.H = cfg, sync_every

        def own() -> torch.nn.Module | None:  # θ₀ built once (a large model takes seconds to initialise)
            return copy.deepcopy(model0) if model0 is not None else None

        if cfg.kind == "ddp":  # the mean gradient of ``members`` batches per step: DDP's update, in one learner
            whole = corpus.whole()  # over every member's data, as the members of a ddp run read theirs
            self.learners = [Learner(run, device, whole, shard=0, batch_size=batch_size, precision=precision,
                                     accumulate=members, model=own())]
        else:
            self.learners = [Learner(run, device, corpus, shard=i, batch_size=batch_size, precision=precision,
                                     model=own()) for i in range(members)]
        first = self.learners[0]
        parts = 1 if cfg.kind != "decoupled" else cfg.fragments
        self.fragments = make_fragments(first.params, parts, sync_every, embedding=embedding_of(first.model))
        self.replicas = [first.gather(f) for f in self.fragments]
        self.bufs = [torch.zeros_like(r) for r in self.replicas]
        self.versions = [0] * len(self.replicas)
        self.ef = [ErrorFeedback() for _ in self.learners]
        self.inflight: dict[int, _Round] = {}
        self.counters = Counters()
        self.step = 0

    # ---- the loop ---------------------------------------------------------------------------------------------
    def train(self, steps: int) -> None:
        """``steps`` inner steps of every learner, with the rounds due among them."""
        for _ in range(steps):
            for learner in self.learners:
                learner.train_step()
            self.step += 1
            self.counters.trained += self.learners[0].tokens_per_step
            if self.cfg.kind == "ddp":
                continue
            self._land_due(started_before=self.step)  # a late round landing as its fragment falls due again
            for p, fragment in enumerate(self.fragments):
                if not fragment.due(self.step, self.H):
                    continue
                if p in self.inflight:  # one round in flight per fragment: this one is skipped
                    self.counters.skipped += 1
                else:
                    self._start(p)
            self._land_due(started_before=self.step + 1)

    def _land_due(self, started_before: int) -> None:
        for p in [p for p, r in self.inflight.items() if r.land_step <= self.step and r.snap_step < started_before]:
            self._land(p)

    def finish(self) -> None:
        """Land the rounds still in flight (the global model then holds every round started)."""
        for p in list(self.inflight):
            self._land(p)

    # ---- rounds -----------------------------------------------------------------------------------------------
    def _start(self, p: int) -> None:
        from atoll.models import outer
        from atoll.protocols import codecs

        cfg, fragment = self.cfg, self.fragments[p]
        base = self.replicas[p]
        snaps = [learner.gather(fragment) for learner in self.learners]
        weights = [1.0] * len(self.learners)  # every member trains at the same pace: equal token weights
        decoded = []
        for i, snap in enumerate(snaps):
            delta = outer.pseudo_gradient(base, snap)
            if cfg.codec == "none":
                decoded.append(delta)
                continue
            target = self.ef[i].target(str(p), delta)
            out = codecs.decode(codecs.encode(target, cfg.codec), expected_numel=target.numel())
            self.ef[i].commit(str(p), target, out)
            decoded.append(out)
        rda = cfg.kind == "decoupled" and cfg.rda and not fragment.has_embedding
        if rda:
            norms = [float(torch.linalg.vector_norm(d.double())) for d in decoded]
            dirs = [d.double() / n if n > 0 else torch.zeros_like(d, dtype=torch.float64)
                    for d, n in zip(decoded, norms)]
            merged = outer.weighted_mean(dirs, weights)
            norm = outer.weighted_norm(norms, weights)
        else:
            merged, norm = outer.weighted_mean(decoded, weights), None
        if cfg.codec != "none":  # the reducer sends its merged shard back encoded
            merged = codecs.decode(codecs.encode(merged.float(), cfg.codec), expected_numel=merged.numel())
        merged = outer.merged_delta([merged], norm)
        value, buf = base.clone(), self.bufs[p]
        outer.NesterovOuter(cfg.outer_lr, cfg.outer_momentum, cfg.outer_period).step(value, buf, merged,
                                                                                     self.versions[p])
        self.versions[p] += 1
        delay = cfg.delay if cfg.kind == "decoupled" else 0
        self.inflight[p] = _Round(self.step + delay, self.step, value, snaps)

    def _land(self, p: int) -> None:
        """Every learner merges round ``p`` by the configuration's rule; Θ_p becomes the round's value."""
        r = self.inflight.pop(p)
        cfg, fragment = self.cfg, self.fragments[p]
        since = self.step - r.snap_step
        fragment_tokens = since * self.learners[0].tokens_per_step // len(self.fragments)
        merge = "overwrite" if cfg.merge == "delta" and cfg.carry_max and since > cfg.carry_max else cfg.merge
        for learner, snap in zip(self.learners, r.snaps):
            if since == 0 or merge == "overwrite":
                learner.put(fragment, r.value)
            elif merge == "mix":
                now = learner.gather(fragment)
                learner.put(fragment, (cfg.alpha * now.double() + (1 - cfg.alpha) * r.value.double()).float())
            else:
                now = learner.gather(fragment)
                learner.put(fragment, (r.value.double() + (now.double() - snap.double())).float())
        if since:
            if merge == "delta":
                self.counters.carried += fragment_tokens
            else:
                self.counters.lost += fragment_tokens
        self.replicas[p] = r.value

    # ---- evaluation -------------------------------------------------------------------------------------------
    def held_out_loss(self, batches: list[torch.Tensor]) -> float:
        """The global model's loss: θ for ddp; for a swarm Θ (every fragment's replica), evaluated in the first
        learner's model, whose θ is put back afterwards."""
        learner = self.learners[0]
        if self.cfg.kind == "ddp":
            return learner.evaluate(batches)
        saved = [learner.gather(f) for f in self.fragments]
        for f, value in zip(self.fragments, self.replicas):
            learner.put(f, value)
        loss = learner.evaluate(batches)
        for f, value in zip(self.fragments, saved):
            learner.put(f, value)
        return loss

    def close(self) -> None:
        for learner in self.learners:
            learner.release(keep=False)


class Data:
    """The corpus dealt into one shard per member, and ``whole()``: the same training tokens as one shard (what
    ddp's one learner reads). Both hold out the same batches."""

    def __init__(self, tokens, seq_len: int, members: int, held_out) -> None:
        from atoll.models.data import Corpus

        self._args = (tokens, seq_len, held_out)
        self.corpus = Corpus(tokens, seq_len, members, held_out=held_out)

    def whole(self):
        from atoll.models.data import Corpus

        tokens, seq_len, held_out = self._args
        return Corpus(tokens, seq_len, 1, held_out=held_out)

    def __getattr__(self, name):  # the rest is the members' corpus
        return getattr(self.corpus, name)


def load(model: str, data: str, members: int, shape=None) -> Data:
    """The corpus of ``data`` (``atoll start --data``'s forms) for ``members`` learners of ``model`` (of ``shape``,
    if built already); ValueError when the data's vocabulary does not fit the model's."""
    from atoll.models.data import load_corpus, load_held_out
    from atoll.models.registry import build_model

    tokens, vocab = load_corpus(data)
    shape = shape or build_model(model, 0)[1]
    if vocab > shape.vocab_size:
        raise ValueError(f"data {data!r} has a vocabulary of {vocab}; model {model!r} takes {shape.vocab_size}")
    return Data(tokens, shape.seq_len, members, load_held_out(data))


def run_configs(configs: list[Config], *, model: str, data: str, device_name: str, members: int, batch_size: int,
                steps: int, sync_every: int, inner_lr: float, warmup: int, eval_batches: int, eval_points: int,
                seed: int = 0, precision: str | None = None, budget_s: float = 0.0, log=print) -> list[Result]:
    """Each configuration from the same θ₀ and data, ``steps`` inner steps per learner, one after the other.

    With ``budget_s`` > 0, ``steps`` is only a cap: the first configuration times its first ``sync_every`` steps and
    every configuration then trains as many steps (a multiple of ``sync_every``) as lets all of them end within
    ``budget_s`` seconds from the call, counting a swarm's rounds and evaluations as ``SWARM_COST`` times ddp's."""
    from atoll.models.registry import build_model
    from atoll.node.config import RunConfig
    from atoll.node.device import resolve_device

    start = time.perf_counter()
    device = resolve_device(device_name)
    run = RunConfig(model=model, data=data, inner_lr=inner_lr, warmup_steps=warmup, seed=seed,
                    sync_every=sync_every)
    model0, shape = build_model(model, seed)
    corpus = load(model, data, members, shape)
    batches = corpus.held_out(eval_batches, batch_size)
    if device.kind == "cuda":  # the rounds' codec runs on the host: use its cores as the daemon's rank 0 would
        from atoll.protocols import codecs

        codecs.set_threads(max(1, min(8, (os.cpu_count() or 2) // 2)))
    results = []
    for c, cfg in enumerate(configs):
        t0 = time.perf_counter()
        if budget_s > 0 and results and t0 - start + results[-1].seconds * 1.1 > budget_s:
            log(f"{cfg.name}: skipped, it would not end within {budget_s:.0f} s")
            continue
        swarm = Swarm(cfg, run, device, corpus, members, batch_size, sync_every, precision, model0)
        curve = []
        done = 0
        if budget_s > 0 and c == 0:
            probe = max(3, min(steps, sync_every))
            swarm.train(2)  # first steps: allocations and kernel choices, slower than the rest
            t1 = time.perf_counter()
            swarm.train(probe - 2)
            done = probe
            per_step = (time.perf_counter() - t1) / (probe - 2)
            left = budget_s - (time.perf_counter() - start)
            weight = 1 + (len(configs) - 1) * SWARM_COST
            fit = int(left / (per_step * weight)) + probe
            steps = max(probe, min(steps, fit // sync_every * sync_every))
            log(f"{per_step * 1000:.0f} ms per step of {cfg.name}: {steps} steps per configuration fit "
                f"{budget_s:.0f} s")
        every = max(1, steps // max(1, eval_points))
        while done < steps:
            n = min(every - done % every, steps - done)
            swarm.train(n)
            done += n
            if done < steps:
                curve.append((done, swarm.held_out_loss(batches)))
                log(f"{cfg.name}: step {done}/{steps} held-out {curve[-1][1]:.4f}")
        swarm.finish()
        final = swarm.held_out_loss(batches)
        curve.append((steps, final))
        tokens = swarm.counters.trained // (members if cfg.kind == "ddp" else 1)
        result = Result(asdict(cfg) | {"name": cfg.name}, steps, tokens, final, curve, asdict(swarm.counters),
                        time.perf_counter() - t0, sum(p.numel() for p in model0.parameters()))
        log(f"{cfg.name}: held-out {final:.4f} after {steps} steps ({result.seconds:.1f} s); "
            f"tokens carried {swarm.counters.carried}, lost {swarm.counters.lost}")
        swarm.close()
        del swarm
        if device.kind == "cuda":
            torch.cuda.empty_cache()
        results.append(result)
    return results


def standard_configs(delay: int, fragments: int, outer_lr: float, outer_momentum: float, codec: str,
                     with_overwrite: bool = True) -> list[Config]:
    """ddp, decoupled with the delta rule, diloco, and (optionally) decoupled overwriting: the comparison the
    device check and the merge-rule benchmark make, in the order a budget that runs out should drop them."""
    base = Config(fragments=fragments, outer_lr=outer_lr, outer_momentum=outer_momentum, codec=codec)
    configs = [replace(base, kind="ddp"), replace(base, kind="decoupled", merge="delta", delay=delay),
               replace(base, kind="diloco")]
    if with_overwrite:
        configs.append(replace(base, kind="decoupled", merge="overwrite", delay=delay))
    return configs


def describe(args: argparse.Namespace, results: list[Result]) -> dict:
    """The JSON of a run: its arguments, the machine, every configuration's result and its ratio to ddp."""
    import platform

    ddp = next((r.held_out for r in results if r.config["kind"] == "ddp"), math.nan)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    params = results[0].parameters if results else 0
    return {"args": vars(args), "device": device, "torch": torch.__version__, "parameters": params,
            "results": [asdict(r) | {"vs_ddp": r.held_out / ddp} for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--delay", type=int, default=5)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--codec", default="int4")
    parser.add_argument("--inner-lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--eval-points", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=0.0, help="seconds for all configurations: --steps is then "
                        "only a cap")
    parser.add_argument("--precision", default=None, help="fp32 or bf16 (default: the device's)")
    parser.add_argument("--no-overwrite", dest="overwrite", action="store_false",
                        help="leave out decoupled with the overwrite rule")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    try:
        configs = standard_configs(args.delay, args.fragments, args.outer_lr, args.outer_momentum, args.codec,
                                   args.overwrite)
        results = run_configs(configs, model=args.model, data=args.data, device_name=args.device,
                              members=args.members, batch_size=args.batch_size, steps=args.steps,
                              sync_every=args.sync_every, inner_lr=args.inner_lr, warmup=args.warmup,
                              eval_batches=args.eval_batches, eval_points=args.eval_points, seed=args.seed,
                              precision=args.precision, budget_s=args.budget_s)
    except (ValueError, KeyError) as e:  # bad arguments, a model or data that does not fit: one line
        print(f"inproc_swarm: {e}", file=sys.stderr)
        return 2
    doc = describe(args, results)
    ddp = next((r.held_out for r in results if r.config["kind"] == "ddp"), math.nan)
    for r in results:
        print(f"{r.config['name']:28s} held-out {r.held_out:.4f}  / ddp {r.held_out / ddp:.4f}")
    if args.out:
        write_result(Path(args.out), doc, seeds=[args.seed])
    return 0


if __name__ == "__main__":
    sys.exit(main())
