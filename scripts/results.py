"""Where a benchmark's figures go: one JSON envelope and one way to save a plot, for every script under scripts/.

A result file is a JSON object that opens with the same keys in every benchmark::

    schema     1
    bench      the script's module name (``bench_wan``)
    command    how to run it again: ``python -m scripts.bench_wan ...`` with the arguments it was given
    git_rev    the checkout's revision (``+dirty`` when it had uncommitted changes)
    machine    cores, platform, Python and torch versions
    seeds      the seeds it ran, where the benchmark has any (else null)
    written_at UTC time of the write

and then holds the benchmark's own figures under keys of its choosing. A file written again by a later invocation
(benchmarks that add runs to an earlier file) keeps the earlier invocations as ``invocations``: each with its
command and revision. Files are replaced atomically, so a benchmark that writes after every point never leaves a
half-written file.

A plot is saved by ``save_figure``: one resolution, and a footer naming the command and revision that drew it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

SCHEMA = 1
DPI = 110
ROOT = Path(__file__).resolve().parent.parent
ENVELOPE = ("schema", "bench", "command", "git_rev", "machine", "seeds", "written_at")


def bench_name() -> str:
    """The running script's module name under scripts/ (``bench_wan``), from ``python -m scripts.X`` or a path."""
    return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "unknown"


def command() -> str:
    """The command line that ran this process, as ``python -m scripts.X args``."""
    return shlex.join(["python", "-m", f"scripts.{bench_name()}", *sys.argv[1:]])


def git_rev(root: Path = ROOT) -> str | None:
    """The checkout's short revision, with ``+dirty`` when tracked files changed; None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    """What the figures were measured on (torch's version only if the benchmark imported torch)."""
    torch = sys.modules.get("torch")
    return {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": getattr(torch, "__version__", None)}


def envelope(seeds: Any = None) -> dict[str, Any]:
    """The keys every result file opens with, for this process now."""
    return {"schema": SCHEMA, "bench": bench_name(), "command": command(), "git_rev": git_rev(),
            "machine": machine(), "seeds": list(seeds) if isinstance(seeds, (list, tuple, range)) else seeds,
            "written_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def stamped(doc: dict[str, Any], seeds: Any = None) -> dict[str, Any]:
    """``doc`` under this process's envelope (``seeds`` defaults to the doc's own ``seeds``). An envelope the doc
    carries from an earlier write (read back from its file: it has ``written_at``) with another command moves into
    ``invocations``; a ``command`` a benchmark spelt itself is replaced by the one that ran."""
    now = envelope(seeds if seeds is not None else doc.get("seeds"))
    figures = {k: v for k, v in doc.items() if k not in ENVELOPE and k != "invocations"}
    earlier = list(doc.get("invocations", []))
    if doc.get("written_at") and doc.get("command") and doc["command"] != now["command"]:
        earlier.append({"command": doc["command"], "git_rev": doc.get("git_rev")})
    return {**now, **({"invocations": earlier} if earlier else {}), **figures}


def write_result(path: str | os.PathLike, doc: dict[str, Any], seeds: Any = None) -> Path:
    """Write ``doc``, stamped (``stamped``), to ``path`` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stamped(doc, seeds), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def pyplot():
    """matplotlib's pyplot, drawing without a display (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save ``fig`` as a PNG at ``DPI`` with a footer naming the command and revision that drew it, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.text(0.995, 0.003, f"{command()}  @ {git_rev() or '?'}", ha="right", va="bottom", fontsize=5, color="0.55")
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path
