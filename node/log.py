"""One logger, ``atoll``, whose lines name the peer and the step."""

from __future__ import annotations

import logging
import sys


class _Context(logging.Filter):
    """Stamps every record with the daemon's short peer id and current inner step."""

    def __init__(self) -> None:
        super().__init__()
        self.peer = "-"
        self.step = 0

    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = self.peer
        record.step = self.step
        return True


context = _Context()
logger = logging.getLogger("atoll")


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(peer)s step %(step)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(context)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    # hivemind logs through its own handler; keep its routine chatter out of the daemon's output.
    logging.getLogger("hivemind").setLevel(logging.WARNING)
