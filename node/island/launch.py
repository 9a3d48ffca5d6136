"""``atoll start --nproc-per-node N``: an island of N ranks on this host (and ``--nnodes`` hosts), launched by
torch's elastic launcher, the engine behind ``torchrun``.

This process becomes the launcher's agent: it starts the ranks (each ``python -m atoll.node.cli start`` with the
same flags, under the launcher's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) and watches them. When one fails, the
launcher stops the others, and this process starts them all again, up to ``--max-restarts`` times: rank 0 resumes
from the island's checkpoint and catches up with the swarm as a restarted daemon does, while the other islands
train on. The restarts are this process's own, one launch per attempt, because a rank that exits 2 (bad
configuration, printed as one line) must not be restarted: it would fail the same way. A stop signal (SIGTERM,
SIGINT) goes to every rank: rank 0 finishes its step, tells the others to stop at the next boundary, checkpoints
and leaves the run.

Exit codes: 0 when the island stopped cleanly (or was told to); 2 at once for bad configuration; else the failing
rank's code when its last attempt failed.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from ..config import NodeConfig

logger = logging.getLogger("atoll")
# The launcher sets this in every rank's environment; a rank must not launch an island of its own.
UNDER_LAUNCHER = "TORCHELASTIC_RUN_ID"
ATTEMPT = "ATOLL_ISLAND_ATTEMPT"  # which launch of the island this is, 0 first (faults.py reads it)


def wants_launcher(cfg: NodeConfig, env: dict[str, str] | None = None) -> bool:
    """Whether ``atoll start`` must launch the island's ranks (rather than be one of them)."""
    env = os.environ if env is None else env
    return (cfg.nproc_per_node > 1 or cfg.nnodes != "1") and UNDER_LAUNCHER not in env


def launch(cfg: NodeConfig, argv: list[str]) -> int:
    """Run ``atoll start`` with ``argv`` (its flags, unchanged) as every rank of the island ``cfg`` describes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    low, _, high = cfg.nnodes.partition(":")
    several_hosts = bool(cfg.rdzv_endpoint)
    for attempt in range(cfg.max_restarts + 1):
        config = LaunchConfig(
            min_nodes=int(low), max_nodes=int(high or low), nproc_per_node=cfg.nproc_per_node,
            run_id=f"atoll-{cfg.run_id}-{attempt}" if several_hosts else str(uuid.uuid4()),
            # One host alone: a rendezvous store of this process's own on a free port (torchrun's --standalone).
            rdzv_backend="c10d", rdzv_endpoint=cfg.rdzv_endpoint or "localhost:0",
            max_restarts=0, monitor_interval=0.5, start_method="spawn")
        logger.info("launching an island of %s host(s) x %d rank(s), attempt %d of %d", cfg.nnodes,
                    cfg.nproc_per_node, attempt + 1, cfg.max_restarts + 1)
        os.environ[ATTEMPT] = str(attempt)
        try:
            elastic_launch(config, sys.executable)("-m", "atoll.node.cli", "start", *argv)
            return 0
        except SignalException as e:  # the ranks were told to stop (and have stopped) before this returns
            logger.info("island stopped on %s", e.sigval.name)
            return 0
        except ChildFailedError as e:
            rank, first = e.get_first_failure()
            if first.exitcode == 2:  # bad configuration: the rank said why, and a restart would say it again
                return 2
            code = first.exitcode if first.exitcode > 0 else 1
            logger.warning("rank %d of the island exited with %d%s", rank, first.exitcode,
                           "; restarting the island" if attempt < cfg.max_restarts else "")
    print(f"atoll: error: the island failed: rank {rank} exited with {first.exitcode} on its last attempt "
          f"(--max-restarts {cfg.max_restarts}); its log is above", file=sys.stderr)
    return code
