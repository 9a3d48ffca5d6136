"""What a daemon's checkpoint holds, and how a restarted daemon takes it back.

A checkpoint is consistent at one step: the learner (θ, optimizer, data position), the replica (Θ, outer momentum,
versions, weights, digests and ancestry per fragment), each fragment's local state (base and token counters), the
error-feedback residuals and the lost-token count. It is captured in host memory on the training loop and written
by ``CheckpointWriter`` in the background (``checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from atoll.models.fragments import Fragment

from ..config import ConfigError, NodeConfig
from ..rounds.local_state import LocalFragmentState
from ..rounds.replica import Replica
from ..trainee import Trainee


def capture(cfg: NodeConfig, peer_id: str, learner: Trainee, replica: Replica, local: list[LocalFragmentState],
            error_feedback: dict[str, torch.Tensor], tokens_lost: int,
            tokens_carried: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (host copies) and metadata of a checkpoint at this step."""
    tensors = dict(learner.state_tensors())
    tensors.update({f"ef.{k}": v for k, v in error_feedback.items()})
    for p, state in enumerate(local):
        tensors.update(state.state_tensors(f"local.{p}"))  # a base is replaced, never written in place
    versions, weights, digests, ancestors = [], [], [], []
    for p in range(replica.num_fragments):
        snap = replica.snapshot(p)
        tensors[f"replica.{p}.params"], tensors[f"replica.{p}.momentum"] = snap.params, snap.momentum
        versions.append(snap.version)
        weights.append(snap.weight)
        digests.append(snap.digest)
        ancestors.append(list(snap.ancestors))
    meta = {
        "run_id": cfg.run_id, "peer_id": peer_id, "run": cfg.run.published(),
        "version": sum(versions), "versions": versions, "weights": weights, "digests": digests,
        "ancestors": ancestors,
        "step": learner.step, "tokens": learner.tokens, "position": learner.position,
        "schedule_step": replica.schedule_step, "counters": [lo.counters() for lo in local],
        "tokens_lost": tokens_lost, "tokens_carried": tokens_carried,
    }
    return tensors, meta


def restore(cfg: NodeConfig, tensors: dict[str, torch.Tensor], meta: dict[str, Any], learner: Trainee,
            fragments: list[Fragment], local: list[LocalFragmentState]) -> tuple[Replica, dict[str, torch.Tensor]]:
    """Load a checkpoint into ``learner`` and ``local``; returns the restored replica and error-feedback state.
    ``ConfigError`` if the checkpoint belongs to another run config; ``Mismatch`` if it does not fit this model
    (a tensor missing or of another shape, a replica that does not match its recorded hashes): ``learner`` and
    ``local`` may then be loaded in part, and must be loaded again from another checkpoint or not used."""
    if not cfg.run.same_run(meta.get("run")):
        raise ConfigError(f"checkpoint_dir: {cfg.checkpoint_dir!r} holds a checkpoint of a different run config")
    try:
        return _restore(tensors, meta, learner, fragments, local)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise Mismatch(f"{type(e).__name__}: {e}") from e


class Mismatch(ValueError):
    """A checkpoint that does not fit the model being restored (``restore``)."""


def _restore(tensors: dict[str, torch.Tensor], meta: dict[str, Any], learner: Trainee, fragments: list[Fragment],
             local: list[LocalFragmentState]) -> tuple[Replica, dict[str, torch.Tensor]]:
    n = len(fragments)
    for p, fragment in enumerate(fragments):
        for part in ("params", "momentum"):
            if tensors[f"replica.{p}.{part}"].numel() != fragment.numel:
                raise ValueError(f"replica.{p}.{part} holds {tensors[f'replica.{p}.{part}'].numel()} values, "
                                 f"fragment {p} has {fragment.numel}")
    replica = Replica([tensors[f"replica.{p}.params"] for p in range(n)],
                      [tensors[f"replica.{p}.momentum"] for p in range(n)], meta["versions"], meta["weights"],
                      meta.get("ancestors"))
    if [d for _, _, d in replica.identities()] != meta["digests"]:
        raise ValueError("the checkpoint's replica does not match its recorded hashes")
    learner.load_state_tensors(tensors)
    learner.step, learner.tokens, learner.position = meta["step"], meta["tokens"], meta["position"]
    replica.schedule_step = meta["schedule_step"]
    for p, counters in enumerate(meta["counters"]):
        state = local[p]
        state.load(tensors, f"local.{p}", counters)
        theta_p, state.base_id = replica.params_and_id(p)
        if not torch.equal(state.base, theta_p):  # a merge was still pending: restart from the replica
            state.restart(theta_p, state.base_id)
            learner.put(fragments[p], theta_p)
    return replica, {k[3:]: v for k, v in tensors.items() if k.startswith("ef.")}
