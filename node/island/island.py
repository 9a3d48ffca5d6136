"""``atoll.Island``: a member of a run around a model whose training loop is someone else's.

``Island(model, optimizer, **options)`` is a ``Member`` (``member.py``: joining, rounds, checkpoints, leaving) that
hooks ``optimizer.step``, so each call of it is a step counted with the tokens of ``island.tokens(n)`` (or
``tokens_per_step``) and followed by a step boundary.

A user's loop under ``torchrun`` (``WORLD_SIZE`` > 1) is an island of several ranks (``ranks.py``): rank 0 is the
member; on every other rank ``Island`` only follows it — it takes rank 0's state at start and, at each boundary,
the parameters rank 0's boundary wrote, and ``stopping`` turns true on every rank after the same step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from atoll.models.data import shard_for_peer
from atoll.models.registry import model_digest

from ..algorithm import algorithm
from ..config import NodeConfig, load_config
from ..log import setup_logging
from ..run_config import OWN_MODEL, ConfigError, RunConfig
from ..trainee import LoopTrainee, device_of, optimizer_params
from .member import Member, logger
from .ranks import IslandSync, Ranks, init_island, leave_island


NO_DDP = "algorithm: ddp (a gradient all-reduce every step) runs in `atoll start` only"


class Island(Member):
    """A member of the run ``options`` name, around your own ``model`` and inner ``optimizer``::

        with atoll.Island(model, optimizer, run_id="myrun", initial_peers=[...], checkpoint_dir="ckpt") as island:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                island.tokens(batch["input_ids"].numel())  # optional: the tokens this step trains
                optimizer.step(); optimizer.zero_grad()  # the step boundary: rounds start and merge here

    Under ``torchrun`` every rank makes its ``Island`` (the model may be wrapped in ``DistributedDataParallel``): rank
    0 joins the run, the others follow it; ``tokens``/``tokens_per_step`` on rank 0 count the island's tokens, every
    rank's, and the loop ends on ``island.stopping`` (``request_stop()`` on any rank ends it after the same step on
    all of them).

    ``options`` are ``atoll start``'s settings by field name (``run_id``, ``initial_peers``, ``algorithm``,
    ``sync_every``, ``checkpoint_dir``, ``open``, ``join_token``, ...; ``config`` a TOML file as ``--config``).
    Settings of the daemon's own loop (``device``, ``batch_size``, ``inner_lr``, ``max_steps``, ...) do not apply:
    the model's device, the optimizer and the loop are yours. Bad settings raise ``ConfigError`` (one line).

    ``evaluate(model) -> float``: your held-out loss, called without gradients at merges within ``eval_budget`` of
    the wall time; without it an island reports no held-out loss, and a lonely island cannot vet a replica
    nobody vouches for, so it refuses every one (docs/security.md). ``tokens_per_step``: the tokens each step
    trains, unless ``tokens(n)`` says otherwise for a step; with neither, a step weighs one token.

    Every island of a run must build the same model (names, shapes and dtypes of its trainable parameters: the
    run's digest) from the same seed; one that does not refuses to join with a ``ConfigError``. The optimizer may
    be any ``torch.optim`` optimizer over the model's trainable parameters; its state is checkpointed with θ.
    After ``start``, ``step`` is how many steps this member trained (restored from a checkpoint: resume your data
    there) and ``shard``/``num_shards`` name the data shard its peer id hashes to.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 evaluate: Callable[[torch.nn.Module], float] | None = None, tokens_per_step: int | None = None,
                 config: str | None = None, **options: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            model = model.module  # the parameters are the wrapped module's, named without DDP's "module." prefix
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if tokens_per_step is not None and not (isinstance(tokens_per_step, int) and tokens_per_step > 0):
            raise ConfigError(f"tokens_per_step: must be a positive int, got {tokens_per_step!r}")
        cfg, explicit = load_config({"model": OWN_MODEL, **options}, config)
        if "model" not in options:
            explicit.discard("model")  # the model is the module itself; its digest is what the run checks
        try:
            device = device_of(model)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        owned = set(optimizer_params(optimizer))
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise ConfigError(f"optimizer: it does not train {len(missing)} of the model's trainable parameters "
                              f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        digest = model_digest(model)
        trainee = LoopTrainee(model, optimizer, device, evaluate)

        def build(agreed: NodeConfig, _peer_id: str) -> LoopTrainee:
            if algorithm(agreed.run.algorithm).gradient_allreduce:  # the run's algorithm, as agreed with the peers
                raise ConfigError(NO_DDP)
            return trainee

        def derive(run: RunConfig) -> dict[str, Any]:
            """The model's digest and, where the loop says what it trains a step, the run's bound on it."""
            if tokens_per_step is None or run.max_step_tokens:
                return {"model_digest": digest}
            return {"model_digest": digest, "max_step_tokens": tokens_per_step}

        super().__init__(cfg, explicit, build, derive, device, threading.Event(), print_addresses=False)
        self._ranks = Ranks.from_env()
        self._sync: IslandSync | None = None  # the collectives with this island's other ranks, if it has any
        self._own_group = False  # whether this island made the process group (it ends it at close)
        self._stop_requested = threading.Event()
        self._agreed_stop = False
        if self._ranks.world > 1:
            if any(hasattr(p, "full_tensor") for p in trainee.params):
                raise ConfigError("model: its parameters are sharded (FSDP); an island of sharded ranks runs in "
                                  "`atoll start --fsdp` only, a Python island under torchrun is data parallel")
            if cfg.run.algorithm == "ddp":
                raise ConfigError(NO_DDP)
            self._own_group = not dist.is_initialized()
            _, control = init_island(self._ranks, device.kind)
            self._sync = IslandSync(self._ranks, trainee.params, control)
            self.rank_sync = self._sync
            self._own_trainee = trainee
        self._tokens_per_step, self._next_tokens, self._next_loss = tokens_per_step, None, None
        self._optimizer = optimizer
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._step_end = 0.0
        if not logger.handlers:  # a script that set up no logging of its own still sees the island's progress
            setup_logging(cfg.log_level, cfg.log_format)

    # ---- what a loop reads ----------------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """True once something asked this island to stop (``request_stop``, or ``close``); on an island of several
        ranks, from the boundary at which every rank learns it."""
        if self._sync is not None:
            return self._agreed_stop
        return self.stop_event.is_set()

    def request_stop(self) -> None:
        """Ask the island to stop after the current step (safe from a signal handler, on any rank)."""
        if self._sync is not None:
            self._stop_requested.set()
        else:
            self.stop_event.set()

    @property
    def following(self) -> bool:
        """True on the ranks of an island other than rank 0: they train, rank 0 is the run's member."""
        return not self._ranks.leader

    def tokens(self, n: int, loss: float | None = None) -> None:
        """The tokens the step now being trained trains (its weight in rounds), and optionally its loss for the
        progress record; read at the next ``optimizer.step()``."""
        if not (isinstance(n, int) and n > 0):
            raise ValueError(f"tokens: must be a positive int, got {n!r}")
        self._next_tokens, self._next_loss = n, loss

    # ---- lifetime -------------------------------------------------------------------------------------------
    def __enter__(self) -> Island:
        self.start()
        return self

    def start(self) -> None:
        """Join the run (``Member.start``) and hook the optimizer's step; on a rank other than 0, follow rank 0.
        ``ConfigError`` (one line) for what the user must fix."""
        try:
            if self.following:
                self._follow()
                return
            super().start()
            if self._sync is not None:  # the other ranks take the agreed config and the state joining gave us
                self.counters.ranks = self._ranks.world
                self._sync.share_config(self.cfg, self.peer_id)
                self._sync.share_state(self.trainee)
        except BaseException:
            self._exit.close()
            raise
        if self._tokens_per_step is None:
            logger.info("the tokens a step trains are not given (tokens_per_step=, or island.tokens(n)): rounds "
                        "weigh a member's steps")
        self._step_end = time.monotonic()
        self._hook = self._optimizer.register_step_post_hook(self._on_optimizer_step)

    def _follow(self) -> None:
        """A rank other than 0: rank 0's config and state, then the hook that keeps this rank in step with it."""
        assert self._sync is not None and self._optimizer is not None
        self.trainee = trainee = self._own_trainee
        self.cfg, self.peer_id = self._sync.receive_config()
        self.num_shards = self.cfg.run.num_shards
        self.shard = shard_for_peer(self.peer_id, self.num_shards)
        self.maddrs: list[str] = []
        self._sync.receive_state(trainee)
        self._step_end = time.monotonic()
        logger.info("rank %d of %d: following rank 0 from step %d", self._ranks.rank, self._ranks.world, trainee.step)
        self._hook = self._optimizer.register_step_post_hook(self._on_optimizer_step)

    def close(self) -> None:
        """Unhook the optimizer and leave the run (``Member.close``); the process group too, where the island
        made it (a script that made its own ends it). Safe to call more than once."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            super().close()
        finally:
            if self._own_group:
                self._own_group = False
                leave_island()

    def _on_optimizer_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """The user's ``optimizer.step()`` returned: a step boundary."""
        seconds = time.monotonic() - self._step_end  # the loop's time since the last boundary: the step's
        tokens = self._next_tokens or self._tokens_per_step or 1
        loss, self._next_tokens, self._next_loss = self._next_loss, None, None
        assert isinstance(self.trainee, LoopTrainee)
        # On xla, cut the graph here: the user's step runs as the same graph every step, and what the boundary does
        # (a snapshot, a merge) is traced apart from it, so nothing in the step's graph depends on the schedule.
        self.device.sync()
        self.trainee.advance(tokens)
        if self.boundary(loss, seconds, self._stop_requested.is_set) and self._sync is not None:
            self._agreed_stop = True
            self.stop_event.set()
        self._step_end = time.monotonic()

