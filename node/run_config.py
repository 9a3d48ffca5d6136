"""What every daemon of a run must agree on: ``RunConfig``, checked field by field, and the pieces of configuration
both halves share (``ConfigError``, ``opt``). The daemon that starts a run publishes its ``RunConfig`` in the DHT
and joiners adopt it (``config.reconcile_run_config``; they refuse to start if one of their explicitly set fields
disagrees). ``config.py`` holds what is local to one daemon and the loading of both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atoll.models.configs import MODELS
from atoll.models.registry import ModelError, check_name
from atoll.models.robust import MERGE_RULES
from atoll.protocols.codecs import CODECS

from .algorithm import AlgorithmName, LocalMerge, algorithm
from .checks import ConfigError

ALGORITHMS = tuple(name.value for name in AlgorithmName)
DEVICES = ("auto", "cpu", "cuda", "xla")


def opt(default: Any, *, help: str, metavar: str | None = None, known: Iterable[str] | None = None,
        switch: bool = False, repeat: bool = False, flag: str | None = None, hidden: bool = False) -> Any:
    """A config field with its command-line documentation (``atoll start``'s flags are made from these).

    ``help`` is the flag's help text (the default is appended from ``default``); ``known``: the accepted values,
    listed in the help (``validate`` checks them); ``switch``: a bool set by a bare flag; ``repeat``: a tuple
    given one value per (repeated) flag rather than several after one flag; ``flag``: the flag when it is not
    ``--<name with '-' for '_'>``; ``hidden``: left out of ``--help``.
    """
    meta: dict[str, Any] = {"help": help}
    if metavar is not None:
        meta["metavar"] = metavar
    if known is not None:
        meta["known"] = tuple(known)
    if switch:
        meta["switch"] = True
    if repeat:
        meta["repeat"] = True
    if flag is not None:
        meta["flag"] = flag
    if hidden:
        meta["hidden"] = True
    return field(default=default, metadata=meta)


LOCAL_DATA = "<local>"  # the run config's ``data`` when the run trains on files of its own (see RunConfig.published)
# The run config's ``model`` when its members build the model in their own Python code (``atoll.Island``): only its
# digest is published, and a daemon joining with ``--model`` names a preset or factory that builds the same one.
OWN_MODEL = "<own>"


@dataclass(frozen=True)
class RunConfig:
    """Shared by every daemon of a run (published in the DHT by the daemon that starts the run)."""

    model: str = opt("tiny", help="a named model shape; hf:PATH, a Hugging Face model from a local config.json or a "
                                  "directory with one (and its weights), with atoll[hf]; or package.module:factory: "
                                  "a function returning your own torch module (docs/models.md)", known=MODELS)
    algorithm: str = opt("decoupled", help="outer algorithm; ddp is a gradient all-reduce every inner step",
                         known=ALGORITHMS)
    data: str = opt("builtin", help="'builtin', a text file or folder, uint16 .bin shards, or a folder from "
                                    "atoll data prepare (docs/data.md)", metavar="PATH")
    sync_every: int = opt(50, help="inner steps between outer rounds", metavar="H")
    # Plain averaging (1, 0) by measurement: under the delta rule the papers' Nesterov (0.7, 0.9) amplifies the work
    # carried from late rounds (docs/results.md, "The merge rule in one process").
    outer_lr: float = opt(1.0, help="outer step size (the papers': 0.7)", metavar="LR")
    outer_momentum: float = opt(0.0, help="outer Nesterov momentum, in [0, 1); 0 with --outer-lr 1 (the default) is "
                                          "plain averaging; the papers': 0.9", metavar="MU")
    outer_period: int = opt(1, help="rounds of a fragment per outer momentum step: N > 1 is Delayed Nesterov (each "
                                    "round moves the replica by LR/N of its delta, the momentum step comes every "
                                    "N-th round); 1 applies the momentum every round", metavar="N")
    inner_lr: float = opt(1e-3, help="AdamW learning rate of the inner steps", metavar="LR")
    weight_decay: float = opt(0.1, help="AdamW weight decay of the inner steps", metavar="WD")
    warmup_steps: int = opt(20, help="inner steps of linear learning-rate warmup, 0 for none", metavar="N")
    seed: int = opt(0, help="seed of the initial model and of the data order")
    num_shards: int = opt(16, help="data shards the corpus is dealt into; a daemon reads the one its peer id "
                                   "hashes to", metavar="N")
    gather_timeout: float = opt(30.0, help="seconds a round waits for expected members", metavar="S")
    round_timeout: float = opt(30.0, help="seconds a reducer waits for missing parts", metavar="S")
    # streaming / decoupled (diloco always uses one fragment, no overlap, every live member):
    fragments: int = opt(4, help="fragments streaming and decoupled synchronize the model in; diloco and ddp use one",
                         metavar="P")
    overlap: int = opt(2, help="inner steps (below --sync-every) between a fragment's snapshot and its merge, "
                               "for streaming and decoupled", metavar="TAU")
    local_merge: str = opt("delta", help="how a learner takes a round's result into its own model: 'delta' keeps "
                                         "the steps it trained while the round was in flight (and its unmerged work "
                                         "when it adopts a newer replica) for its next contribution; 'overwrite' "
                                         "drops them; 'mix' keeps --alpha of its own model",
                           known=tuple(LocalMerge))
    alpha: float = opt(0.0, help="--local-merge mix: share of the local model kept at a merge, in (0, 1): local <- "
                                 "A*local + (1-A)*merged", metavar="A")
    quorum: int = opt(1, help="minimum members before a round may close (decoupled); ddp: daemons that start "
                              "together", metavar="K")
    max_group: int = opt(16, help="round-size cap: more ready daemons form several groups, whose results are "
                                  "then merged into one", metavar="N")
    grace_gamma: float = opt(0.5, help="share of the overlap's slack a round may wait for more members, in [0, 1)",
                             metavar="G")
    # Without the join window (atoll.node.rounds.waits.join_window), at τ·step_time below a second, rounds
    # close before a peer a few steps off its schedule has joined, and the peers left out drop their unmerged work.
    join_window: bool = opt(True, help="decoupled, with --grace-gamma > 0: a round waits at least as long as a "
                                       "peer needs to notice and join it")
    stale_contributions: bool = opt(False, help="decoupled: when a fork our rounds were on loses, contribute our part "
                                                "of those rounds again (and keep unmerged work at an adoption even "
                                                "with --local-merge overwrite)")
    rda: bool = opt(True, help="decoupled: radial-directional averaging for non-embedding fragments")
    # int4 with error feedback is the default because it measured at parity with fp32 (docs/results.md).
    compression: str = opt("int4", help="codec of outer deltas on the wire", known=CODECS)
    error_feedback: bool = opt(True, help="keep what quantization dropped and add it to the next delta")
    codec_block: int = opt(256, help="values per scale in the blockwise codecs, a multiple of 4", metavar="N")
    # Robust merging (atoll.models.robust). 4 sits just above the spread of honest contributions measured in a
    # swarm with a slow daemon, and keeps what an attacker just below it can weigh small (docs/security.md).
    clip_factor: float = opt(4.0, help="robust merging: a reducer scales every contribution (and declared weight or "
                                       "RDA norm) above F x the round's lower median to the lower median; 0 turns it "
                                       "off",
                             metavar="F")
    # trimmed is the default: with one or two members it is the weighted mean, from three on it bounds a member
    # pointing anywhere (docs/security.md: what it costs an honest swarm and what it saves under attack).
    model_digest: str = opt("", help="digest of the model's parameter names, shapes and dtypes; set by the daemon "
                                     "that starts the run, checked by every joiner", hidden=True)
    tokenizer: str = opt("", help="how the run's data was tokenized: 'bytes', a prepared dataset's tokenizer sha256, "
                                   "or '' (not said); set by the daemon that starts the run, checked by every joiner",
                         hidden=True)
    global_batch: int = opt(0, help="sequences per inner step of every island, over its ranks and micro-batches: an "
                                    "island accumulates global_batch / (batch_size x ranks) micro-batches; 0: each "
                                    "island trains batch_size x grad_accum x ranks", metavar="N")
    max_step_tokens: int = opt(0, help="tokens one island may count for one inner step: a contribution declares "
                                      "at most the weight of this many a step for 2 rounds of steps, more is cut to "
                                      "that; 0: set by the daemon that starts the run to its own tokens a step (the "
                                      "global batch's where --global-batch is set), and a joiner that trains more a "
                                      "step refuses to start", metavar="N")
    robust_merge: str = opt(
        "trimmed", help="how a reducer merges its shard's contributions, after the clips: 'clip' the weighted mean; "
                        "'trimmed' (default) a coordinate-wise trimmed mean (floor(M/4) values, at least 1 from 3 "
                        "members on, dropped at each end; the weighted mean with 1 or 2 members); 'centered' "
                        "centered clipping from the coordinate median. The last two also bound a member at a typical "
                        "norm pointing anywhere", known=MERGE_RULES)

    def validate(self) -> None:
        try:
            if self.model != OWN_MODEL:
                check_name(self.model)
        except ModelError as e:
            raise ConfigError(f"model: {e}") from None
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm: unknown {self.algorithm!r}; known: {', '.join(ALGORITHMS)}")
        if self.data != "builtin" and not Path(self.data).exists():
            raise ConfigError(f"data: {self.data!r} is neither 'builtin' nor an existing path")
        require_positive(self, "sync_every", "num_shards", "outer_lr", "outer_period", "inner_lr", "gather_timeout",
                  "round_timeout", "fragments", "quorum", "max_group")
        require_non_negative(self, "warmup_steps", "weight_decay", "seed", "overlap", "global_batch",
                             "max_step_tokens")
        if self.gather_timeout > 885:  # a round's records live 4 gather timeouts + 60 s; the DHT caps them at 1 h
            raise ConfigError(f"gather_timeout: at most 885 s, got {self.gather_timeout}")
        if self.local_merge not in tuple(LocalMerge):
            raise ConfigError(f"local_merge: unknown {self.local_merge!r}; known: {', '.join(LocalMerge)}")
        if self.local_merge == LocalMerge.MIX and not 0 < self.alpha < 1:
            raise ConfigError(f"alpha: --local-merge mix needs a share in (0, 1), got {self.alpha}")
        if self.local_merge != LocalMerge.MIX and self.alpha:
            raise ConfigError(f"alpha: applies to --local-merge mix only (this run merges by {self.local_merge})")
        if not 0 <= self.grace_gamma < 1:
            raise ConfigError(f"grace_gamma: must be in [0, 1), got {self.grace_gamma}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum: must be in [0, 1), got {self.outer_momentum}")
        if self.compression not in CODECS:
            raise ConfigError(f"compression: unknown codec {self.compression!r}; known: {', '.join(CODECS)}")
        if self.codec_block <= 0 or self.codec_block % 4:
            raise ConfigError(f"codec_block: must be a positive multiple of 4, got {self.codec_block}")
        factor = self.clip_factor
        if not (isinstance(factor, (int, float)) and (factor == 0 or 1 <= factor < math.inf)):
            raise ConfigError(f"clip_factor: must be 0 (off) or a finite number >= 1, got {self.clip_factor!r}")
        if self.robust_merge not in MERGE_RULES:
            raise ConfigError(f"robust_merge: unknown {self.robust_merge!r}; known: {', '.join(MERGE_RULES)}")
        if self.overlap >= self.sync_every:
            raise ConfigError(f"overlap: must be smaller than sync_every ({self.sync_every}), got {self.overlap}")

    @property
    def num_fragments(self) -> int:
        return algorithm(self.algorithm).num_fragments(self.fragments)

    @property
    def overlap_steps(self) -> int:
        return algorithm(self.algorithm).overlap_steps(self.overlap)

    def published(self) -> dict[str, Any]:
        """The fields every daemon of the run shares, as the run's config record holds them. A data path is this
        machine's, and anyone who reaches the DHT can read the record: it is published as ``LOCAL_DATA`` only,
        and every joiner names its own copy with ``--data``."""
        fields = dataclasses.asdict(self)
        if fields["data"] != "builtin":
            fields["data"] = LOCAL_DATA
        return fields

    def same_run(self, saved: Any) -> bool:
        """Whether ``saved`` (``published()`` as a checkpoint recorded it) is this config. A field the recording
        version did not have yet counts as its default: a checkpoint of an older atoll resumes with a newer one."""
        if not isinstance(saved, dict):
            return False
        missing = {f.name: f.default for f in dataclasses.fields(self) if f.name not in saved}
        return {**missing, **saved} == self.published()


def require_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}: must be a positive number, got {value!r}")


def require_non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name}: must be a non-negative number, got {value!r}")
