"""Crash-safe checkpoints: safetensors + JSON metadata, written atomically and verified on load.

Each checkpoint is a pair ``ckpt-NNNNNNNN.safetensors`` / ``ckpt-NNNNNNNN.json``. The tensors are written to a
temporary file, fsynced and renamed first; the JSON (which holds the tensors' sha256) is written the same way
last, so a checkpoint exists only once both are complete. Loading takes the newest pair that verifies, so a
daemon killed while writing restarts from its previous good checkpoint. The two newest pairs are kept; temporary
files a killed writer left behind are removed by the next write. ``CheckpointWriter`` writes them on a background
thread, so that training never waits for the disk.

A checkpoint can never make things worse than the one before it: tensors holding NaN or infinity are not written
(the newest intact checkpoint stays, where it would have been pushed out), and a checkpoint is used only if its
tensor file is the one of its own name in the directory (a JSON naming ``../x`` reads nothing outside it), its
bytes match their hash and every value is finite; else the next older one is tried, with one log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..progress import track

logger = logging.getLogger("atoll")
KEEP = 2
GROW_EVERY = 0.5  # seconds between two looks at a checkpoint file's size while it is written


def _fsync_write(path: Path, write, interrupt: Callable[[Path], None] | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    if interrupt is not None:
        interrupt(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _sha256(path: Path, progress: Callable[[int], None] = lambda done: None) -> str:
    h, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            done += len(block)
            progress(done)
    return h.hexdigest()


def _growing(path: Path, progress: Callable[[int], None]) -> Callable[[], None]:
    """Report ``path``'s size to ``progress`` every ``GROW_EVERY`` seconds from a thread of its own, while a library
    call writes it in one piece (safetensors' ``save_file`` reports nothing); the returned call stops it."""
    stop, every = threading.Event(), GROW_EVERY

    def watch() -> None:
        while not stop.wait(every):
            try:
                progress(path.stat().st_size)
            except OSError:  # not created yet
                pass

    thread = threading.Thread(target=watch, name="atoll-checkpoint-size", daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join()

    return end


def _sequence_numbers(directory: Path) -> list[int]:
    out = []
    for p in directory.glob("ckpt-*.json"):
        try:
            out.append(int(p.stem.split("-")[1]))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of a floating-point tensor of ``tensors`` holding NaN or infinity, or None if there is none."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def save_checkpoint(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                    interrupt: Callable[[Path], None] | None = None) -> Path:
    """Atomically write a new checkpoint; returns the JSON path. ``ValueError`` (nothing written) if a tensor holds
    NaN or infinity: such a checkpoint would push out an intact one.

    ``interrupt`` (fault injection) is called with the tensors' temporary file once it is written, before it is
    fsynced and renamed: a hook that truncates it and kills the process is a crash in the middle of the write.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob("ckpt-*.tmp"):  # left by a writer that died; never part of a checkpoint
        stale.unlink(missing_ok=True)
    seq = (_sequence_numbers(d) or [0])[-1] + 1
    st_path, js_path = d / f"ckpt-{seq:08d}.safetensors", d / f"ckpt-{seq:08d}.json"
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    bad = non_finite(cpu)
    if bad is not None:
        raise ValueError(f"{bad} holds NaN or infinity")
    size = max(1, sum(t.numel() * t.element_size() for t in cpu.values()))
    # Written, then read back for its hash: twice the tensors' bytes of work.
    with track(f"checkpoint {seq}: writing {st_path.name}", 2 * size) as bar:
        def write(tmp: Path) -> None:
            stop = _growing(tmp, bar.update)
            try:
                save_file(cpu, str(tmp))
            finally:
                stop()

        _fsync_write(st_path, write, interrupt)
        written = st_path.stat().st_size  # the tensors and safetensors' header
        bar.resize(2 * written)
        digest = _sha256(st_path, lambda done: bar.update(written + done))
    body = json.dumps({**meta, "tensors_sha256": digest, "tensors_file": st_path.name}, indent=1)
    _fsync_write(js_path, lambda tmp: tmp.write_text(body))
    for old in _sequence_numbers(d)[:-KEEP]:
        for suffix in (".json", ".safetensors"):
            (d / f"ckpt-{old:08d}{suffix}").unlink(missing_ok=True)
    return js_path


def checkpoints(directory: str | os.PathLike) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """The checkpoints that verify, newest first (each read when the caller asks for it). Corrupt, partial or
    non-finite ones are logged and skipped."""
    d = Path(directory)
    if not d.is_dir():
        return
    for seq in reversed(_sequence_numbers(d)):
        js_path = d / f"ckpt-{seq:08d}.json"
        try:
            meta = json.loads(js_path.read_text())
            if not isinstance(meta, dict) or meta.get("tensors_file") != f"ckpt-{seq:08d}.safetensors":
                raise ValueError(f"it names the tensor file {meta.get('tensors_file')!r}, not its own"
                                 if isinstance(meta, dict) else "its metadata is not a mapping")
            st_path = d / meta["tensors_file"]
            with track(f"checkpoint {seq}: checking {st_path.name}", max(1, st_path.stat().st_size)) as bar:
                if _sha256(st_path, bar.update) != meta["tensors_sha256"]:
                    raise ValueError("tensor file hash mismatch")
            tensors = load_file(str(st_path))
            bad = non_finite(tensors)
            if bad is not None:
                raise ValueError(f"{bad} holds NaN or infinity")
        except (OSError, ValueError, KeyError) as e:
            logger.warning("checkpoint %s is unusable (%s); trying an older one", js_path.name, e)
            continue
        yield tensors, meta


def load_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies (``checkpoints``), or None."""
    return next(iter(checkpoints(directory)), None)


class CheckpointWriter:
    """Writes checkpoints on a background thread, one at a time and in order: ``submit`` hands over tensors the
    caller no longer touches (host copies) and returns; it waits only while the previous write is still going, so
    no checkpoint is skipped or overtaken. ``on_written(meta)`` is called from the writer thread after each
    write. A write that fails (a full disk) is logged and counted; the previous checkpoint stays the one loaded."""

    def __init__(self, directory: str | os.PathLike, on_written: Callable[[dict[str, Any]], None]) -> None:
        self.directory, self.on_written = directory, on_written
        self.failures = 0
        self._thread: threading.Thread | None = None

    def submit(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
               interrupt: Callable[[Path], None] | None = None) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(tensors, meta, interrupt), name="atoll-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _write(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
               interrupt: Callable[[Path], None] | None) -> None:
        try:
            save_checkpoint(self.directory, tensors, meta, interrupt)
        except Exception as e:  # training goes on; the next checkpoint tries again
            self.failures += 1
            logger.error("checkpoint of step %s could not be written (%r); the previous one stays", meta.get("step"), e)
            return
        self.on_written(meta)

    def busy(self) -> bool:
        """Whether a write is in progress."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
