"""When a daemon lends its machine: the reasons to pause, and when to leave for good (``--pause-when``,
``--schedule``, ``atoll pause``, ``--max-hours``, ``--until``).

A daemon is paused while any reason holds: the operator's ``atoll pause`` (until ``atoll resume``), or one of its
policies:

- ``busy[:CORES]``: another process wants the machine. On CUDA with NVML (the ``nvidia-ml-py`` package), a compute
  process that is not this daemon's on its GPU; elsewhere (a TPU host, the CPU, CUDA without NVML) the host's CPU
  time used by processes outside this daemon's own process tree, at least ``CORES`` cores (default 1) over the last
  sample. What it cannot see: on a TPU host, a job whose work stays on the TPU and leaves the host's cores idle;
  with NVML in another pid namespace, which contexts are ours (``GpuBusy`` then counts those beyond one).
- ``file:PATH``: the file exists (a team's scheduler touches it when it wants the machine back).
- ``--schedule HH:MM-HH:MM``: the daemon trains inside that window of the host's local time (it may cross
  midnight) and is paused outside it.

A policy pauses at its first sample that holds and releases once it has not held for ``resume_after`` seconds, so a
job that idles for a moment does not hand the machine back and forth. Policies are sampled at most every
``SAMPLE_EVERY`` seconds from the training loop (at a step boundary, or in the paused daemon's wait); the clock and
every reading are injectable so tests drive them deterministically.

This module decides; the island carries a pause out (``Member.pause``/``resume``) and the daemon's loop asks
(``daemon.py``). Nothing here touches the network.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..pause_specs import parse_window

SAMPLE_EVERY = 2.0  # seconds between samples of a policy: reading /proc or NVML costs a few ms
DEFAULT_BUSY_CORES = 1.0
OPERATOR = "operator"


# ---- policies --------------------------------------------------------------------------------------------------
class Policy:
    """One reason to pause that the daemon samples itself. ``holds()`` reads the world now."""

    name = "policy"

    def holds(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FilePresent(Policy):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.name = f"file:{path}"

    def holds(self) -> bool:
        return os.path.exists(self.path)  # False too for a path we may not look at


def in_window(now: dt.time, start: dt.time, end: dt.time) -> bool:
    """Whether ``now`` lies in [start, end), a window that crosses midnight when end < start."""
    if start < end:
        return start <= now < end
    return now >= start or now < end


class Schedule(Policy):
    """Holds (pauses) outside the training window ``HH:MM-HH:MM`` of local time."""

    def __init__(self, window: str, now: Callable[[], dt.datetime] = dt.datetime.now) -> None:
        self.start, self.end = parse_window(window)
        self.now = now
        self.name = f"schedule {window.strip()}"

    def holds(self) -> bool:
        return not in_window(self.now().time(), self.start, self.end)


def _read_proc_stat() -> int:
    """Busy CPU time of the whole host, in clock ticks (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def _read_processes() -> dict[int, tuple[int, int]]:
    """Every process's (parent pid, CPU ticks used, its own and its reaped children's)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:  # it ended while we looked
            continue
        rest = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        ppid, ticks = int(rest[1]), sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
        out[int(entry.name)] = (ppid, ticks)
    return out


def tree_of(root: int, processes: dict[int, tuple[int, int]]) -> set[int]:
    """``root`` and every descendant of it in ``processes`` (pid -> (ppid, ...))."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


class HostLoad(Policy):
    """Holds while processes outside this daemon's tree use at least ``cores`` of the host's CPU time: the host's
    busy ticks since the last sample less those of our own process tree (the daemon, its DHT process, p2pd)."""

    def __init__(self, cores: float = DEFAULT_BUSY_CORES, pid: int | None = None,
                 read_host: Callable[[], int] = _read_proc_stat,
                 read_processes: Callable[[], dict[int, tuple[int, int]]] = _read_processes,
                 clock: Callable[[], float] = time.monotonic, ticks_per_s: float | None = None) -> None:
        self.cores, self.pid = cores, pid if pid is not None else os.getpid()
        self.read_host, self.read_processes, self.clock = read_host, read_processes, clock
        self.ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self.name = f"busy:{cores:g} (host cores used by other processes)"
        self.last_cores: float | None = None  # other processes' load at the last sample
        self._last: tuple[float, int, dict[int, int]] | None = None

    def _sample(self) -> tuple[float, int, dict[int, int]]:
        processes = self.read_processes()
        ours = {pid: processes[pid][1] for pid in tree_of(self.pid, processes) if pid in processes}
        return self.clock(), self.read_host(), ours

    def holds(self) -> bool:
        now = self._sample()
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return False  # the first sample only starts the clock
        # Our tree's ticks since the last sample, counted per process that lived through both (a process that
        # started since counts from zero; one that ended counted its last ticks in the host's figure, not ours).
        ours = sum(ticks - last[2].get(pid, 0) for pid, ticks in now[2].items())
        others = (now[1] - last[1] - ours) / self.ticks_per_s / (now[0] - last[0])
        self.last_cores = max(0.0, others)
        return self.last_cores >= self.cores


class GpuBusy(Policy):
    """Holds while a compute process that is not in this daemon's tree runs on our GPU (NVML; ``handle`` found by
    the device's UUID, so ``CUDA_VISIBLE_DEVICES`` is respected).

    In a container with its own pid namespace NVML reports the host's pids, and none of them is ours. The daemon
    holds a CUDA context on its GPU whenever it samples (training, or paused: the context stays), so when the
    first sample lists processes and none of ours, pids cannot be matched: from then on any process beyond the one
    context that is ours counts as another's. An NVML error is logged once and reads as not busy."""

    def __init__(self, nvml: Any, handle: Any, pid: int | None = None,
                 read_processes: Callable[[], dict[int, tuple[int, int]]] = _read_processes,
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.nvml, self.handle, self.pid = nvml, handle, pid if pid is not None else os.getpid()
        self.read_processes, self.log = read_processes, log
        self.name = "busy (another process on this GPU)"
        self.unmapped: bool | None = None  # whether NVML's pids are another namespace's (decided at first sight)
        self._failed = False

    def holds(self) -> bool:
        try:
            running = [proc.pid for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)]
        except Exception as e:  # noqa: BLE001 — a failing driver must not stop training
            if not self._failed:
                self.log(f"pause-when busy: NVML failed ({type(e).__name__}: {e}); not pausing for it")
                self._failed = True
            return False
        ours = tree_of(self.pid, self.read_processes())
        if self.unmapped is None and running:
            self.unmapped = not any(pid in ours for pid in running)
            if self.unmapped:
                self.log("pause-when busy: NVML lists no process of ours (another pid namespace): counting "
                         "processes on the GPU beyond our own one instead")
        if self.unmapped:
            return len(running) > 1
        return any(pid not in ours for pid in running)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 — a failing NVML must not fail the daemon's exit
            pass


def _nvml_handle(nvml: Any, device_index: int) -> Any:
    """Our GPU's NVML handle, by the UUID torch sees (NVML numbers GPUs without ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def busy_policy(spec: str, device_kind: str, device_index: int | None, log: Callable[[str], None]) -> Policy:
    """``busy`` or ``busy:CORES`` for this device: NVML's view of the GPU when it can be had, else the host's load
    (``log`` says which)."""
    _, _, arg = spec.partition(":")
    cores = float(arg) if arg else DEFAULT_BUSY_CORES
    if device_kind == "cuda" and not arg:
        try:
            import pynvml  # nvidia-ml-py: not a dependency of atoll

            pynvml.nvmlInit()
            return GpuBusy(pynvml, _nvml_handle(pynvml, device_index or 0), log=log)
        except Exception as e:  # noqa: BLE001 — missing package, no driver: fall back to the host
            log(f"pause-when busy: NVML is not available ({type(e).__name__}); watching the host's load instead")
    return HostLoad(cores)


# ---- the state: who wants the daemon paused -------------------------------------------------------------------
@dataclass
class _Held:
    policy: Policy
    holding: bool = False
    clear_since: float | None = None  # when the policy stopped holding (it releases resume_after later)


@dataclass
class PauseState:
    """Why the daemon is paused, and when it must leave (``deadline``, monotonic; None for never).

    ``request(True)``/``request(False)`` are the operator's (thread-safe: the control socket's thread calls them);
    ``reasons()`` samples the policies (from the training loop) and returns every reason that holds now.
    """

    policies: list[Policy] = field(default_factory=list)
    resume_after: float = 60.0
    deadline: float | None = None
    clock: Callable[[], float] = time.monotonic
    paused: bool = False  # the island is paused now (set by the loop, read by the control socket)
    step: int = 0
    changed: threading.Event = field(default_factory=threading.Event)  # the operator asked for something

    def __post_init__(self) -> None:
        self._operator = False
        self._held = [_Held(p) for p in self.policies]
        self._sampled = -float("inf")
        self._lock = threading.Lock()

    def request(self, pause: bool) -> None:
        with self._lock:
            self._operator = pause
        self.changed.set()

    @property
    def operator(self) -> bool:
        with self._lock:
            return self._operator

    def reasons(self) -> list[str]:
        """Every reason that holds now; the policies are sampled again once ``SAMPLE_EVERY`` has passed."""
        now = self.clock()
        if now - self._sampled >= SAMPLE_EVERY:
            self._sampled = now
            for held in self._held:
                if held.policy.holds():
                    held.holding, held.clear_since = True, None
                elif held.holding:
                    held.clear_since = now if held.clear_since is None else held.clear_since
                    if now - held.clear_since >= self.resume_after:
                        held.holding, held.clear_since = False, None
        return self.holding()

    def holding(self) -> list[str]:
        """The reasons that held at the last sample (the operator's as of now), without sampling again."""
        return ([OPERATOR] if self.operator else []) + [h.policy.name for h in self._held if h.holding]

    def expired(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline

    def close(self) -> None:
        for held in self._held:
            held.policy.close()


def policies_of(specs: Iterable[str], schedule: str, device_kind: str, device_index: int | None,
                log: Callable[[str], None]) -> list[Policy]:
    """The policies ``--pause-when`` and ``--schedule`` name (checked already by the config)."""
    out: list[Policy] = []
    for spec in specs:
        kind, _, arg = spec.partition(":")
        out.append(busy_policy(spec, device_kind, device_index, log) if kind == "busy" else FilePresent(arg))
    if schedule:
        out.append(Schedule(schedule))
    return out
