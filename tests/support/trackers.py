"""Readers of the files experiment trackers write, for the tests of ``node/ops/trackers.py`` and of live daemons."""

from __future__ import annotations

import glob
import struct
import time


def wandb_history(run_dir, timeout=30.0):
    """The history rows of a W&B run directory's ``run-*.wandb`` file (a LevelDB-style log of protobuf records:
    32 KiB blocks, each record a 7-byte header of crc32, length and type, then its bytes), once the file holds the
    run's ``exit`` record: ``run.finish()`` can return before wandb's service process wrote the records out (under
    make test's load the file was read with no history in it, and held both rows and the exit a moment later).
    AssertionError if no exit record came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        rows, ended = _wandb_records(run_dir)
        if ended:
            return rows
        assert time.monotonic() < deadline, f"no exit record in {run_dir}'s .wandb file after {timeout:.0f} s"
        time.sleep(0.2)


def _wandb_records(run_dir):
    """(history rows, whether the exit record was read) of the run's ``.wandb`` file as it is now."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(f"{run_dir}/run-*.wandb")
    data, pos, pending, rows, block, ended = open(path, "rb").read(), 7, b"", [], 32768, False
    if len(data) < 7:  # not written yet
        return rows, ended
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding (LevelDB's preallocated type): the rest of this block is empty
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
            ended = ended or record.WhichOneof("record_type") == "exit"
    return rows, ended
