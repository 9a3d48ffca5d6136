"""Envelopes for atoll's RPCs: msgpack dicts carried in hivemind's generic ``ExpertRequest``/``ExpertResponse``.

Tensors travel as raw little-endian fp32 bytes split into parts well under hivemind's 4 MiB message cap, so
no custom ``.proto`` is needed and atoll owns its byte format. Every decoder here raises ``WireError`` on
malformed input; callers log it, count it, and treat the sender as missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import torch
from hivemind.proto import runtime_pb2

PART_BYTES = 512 * 1024
MAX_MESSAGE_BYTES = 2 * PART_BYTES


class WireError(ValueError):
    """A message from the network that atoll refuses to use; ``kind`` names the check it failed (the rejection
    counters of the progress record are keyed by it)."""

    def __init__(self, message: str, kind: str = "protocol") -> None:
        super().__init__(message)
        self.kind = kind


def pack_request(msg: dict[str, Any]) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=msgpack.packb(msg, use_bin_type=True))


def pack_response(msg: dict[str, Any]) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb(msg, use_bin_type=True))


def unpack(message: Any, required: dict[str, type]) -> dict[str, Any]:
    """Decode an envelope and check that ``required`` keys exist with the given types."""
    raw = getattr(message, "metadata", None)
    if not isinstance(raw, bytes) or len(raw) > MAX_MESSAGE_BYTES:
        raise WireError("missing or oversized metadata", "oversize" if isinstance(raw, bytes) else "protocol")
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise WireError(f"undecodable message: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise WireError("message is not a map")
    return check_fields(msg, required)


def check_fields(msg: dict[str, Any], required: dict[str, type]) -> dict[str, Any]:
    """Check that ``required`` keys exist with the given types (an int is accepted for a float)."""
    for key, typ in required.items():
        if key not in msg:
            raise WireError(f"message lacks {key!r}")
        value = msg[key]
        if isinstance(value, bool) and typ is not bool:
            ok = False
        elif typ is float:
            ok = isinstance(value, (int, float))
        else:
            ok = isinstance(value, typ)
        if not ok:
            raise WireError(f"field {key!r} has type {type(value).__name__}, expected {typ.__name__}")
    return msg


def tensor_to_parts(flat: torch.Tensor, part_bytes: int = PART_BYTES) -> Iterator[bytes]:
    """Yield the raw fp32 bytes of ``flat`` in parts of at most ``part_bytes``."""
    data = flat.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    for start in range(0, max(len(data), 1), part_bytes):
        yield data[start : start + part_bytes]


def parts_to_tensor(parts: list[bytes], numel: int) -> torch.Tensor:
    """Rebuild a flat fp32 tensor; rejects a wrong size and non-finite values."""
    data = b"".join(parts)
    if len(data) != 4 * numel:
        raise WireError(f"payload has {len(data)} bytes, expected {4 * numel}", "shape")
    out = torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())
    if not torch.isfinite(out).all():
        raise WireError("payload holds NaN or Inf", "nonfinite")
    return out
