"""Readers of the files experiment trackers write, for the tests of ``node/ops/trackers.py`` and of live daemons."""

from __future__ import annotations

import glob
import struct


def wandb_history(run_dir):
    """The history rows of a W&B run directory's ``run-*.wandb`` file (a LevelDB-style log of protobuf records:
    32 KiB blocks, each record a 7-byte header of crc32, length and type, then its bytes)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(f"{run_dir}/run-*.wandb")
    data, pos, pending, rows, block = open(path, "rb").read(), 7, b"", [], 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding (LevelDB's preallocated type): the rest of this block is empty
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
    return rows
