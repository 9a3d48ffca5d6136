"""Error feedback for the lossy codecs (``codecs.py``): what quantization dropped from one round's delta is kept
per key (fragment) and added to that key's next delta, so the running sum of what was sent stays within one
round's quantization error of the running sum of the true deltas (docs/codecs.md, "Error feedback")."""

from __future__ import annotations

import threading

import torch

from .codecs import flat_fp32


class ErrorFeedback:
    """Per-key residual memory (keys like fragment ids) for error-feedback compression.

    ``target(key, delta)`` is what to encode: ``delta`` plus the residual of ``key``; ``commit(key, target,
    decoded)`` keeps what quantization dropped of it as the new residual. What one round drops is thus sent in
    later ones: the running sum of decoded deltas differs from the running sum of true deltas by exactly the
    current residual, which stays within one round's quantization error instead of growing with the number of
    rounds. A target that was not used (its round failed, or encoding raised) is simply not committed, and the
    residual stays as it was. Residuals are fp32 CPU tensors; ``state_dict`` and ``load_state_dict`` are for
    checkpoints. One thread targets and commits (the rounds'); ``residuals`` and ``state_dict`` may be called from
    any other (a checkpoint's).
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # around changes to the dict and copies of it

    def target(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        """``delta`` plus the stored residual of ``key``, as a new flat fp32 tensor (``delta`` is untouched).

        Raises ``ValueError`` when ``delta`` and the stored residual differ in size.
        """
        d = flat_fp32(delta)
        res = self._residuals.get(key)
        if res is not None and res.numel() != d.numel():
            raise ValueError(f"error feedback {key!r}: delta has {d.numel()} elements, residual {res.numel()}")
        return d + res if res is not None else d.clone()

    def commit(self, key: str, target: torch.Tensor, decoded: torch.Tensor) -> None:
        """Store ``target − decoded`` (what quantization dropped) as the residual of ``key``; none when lossless."""
        residual = flat_fp32(target) - flat_fp32(decoded)
        with self._lock:
            if bool(torch.count_nonzero(residual)):
                self._residuals[key] = residual
            else:
                self._residuals.pop(key, None)

    def residuals(self) -> dict[str, torch.Tensor]:
        """The residuals as they are now, without copying them: ``commit`` replaces a key's tensor and never
        writes one in place, so the tensors returned keep this moment's values."""
        with self._lock:
            return dict(self._residuals)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of all residuals, ``{key: flat fp32 tensor}``."""
        return {k: v.clone() for k, v in self.residuals().items()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with (copies of) ``d``; ValueError on non-float or non-finite tensors."""
        new = {}
        for k, v in d.items():
            t = flat_fp32(v).clone()
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"error feedback state {k!r} contains NaN/Inf")
            new[str(k)] = t
        with self._lock:
            self._residuals = new
