"""One logger, ``atoll``, whose lines name the peer and the step: as text for people, or as JSON for log shippers
(``--log-format json``)."""

from __future__ import annotations

import enum
import json
import logging
import sys
import time
from typing import Any


class LogFormat(enum.Enum):
    TEXT = "text"
    JSON = "json"


class _Context(logging.Filter):
    """Stamps every record with the daemon's peer id (``peer``: its last 8 characters, as the text lines show it)
    and current inner step."""

    def __init__(self) -> None:
        super().__init__()
        self.peer_id = ""
        self.step = 0

    def filter(self, record: logging.LogRecord) -> bool:
        record.peer_id = self.peer_id
        record.peer = self.peer_id[-8:] or "-"
        record.step = self.step
        return True


class JSONFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``peer_id`` (null before the
    daemon has one), ``step``, ``message``, and ``exception`` when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = {"time": when, "level": record.levelname, "peer_id": getattr(record, "peer_id", "") or None,
                "step": getattr(record, "step", None), "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class _ConsoleHandler(logging.Handler):
    """Log lines through the terminal's rich console, so that they print above the progress bars it draws
    (``node/progress.py``) instead of through them."""

    def __init__(self, console: Any) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False, emoji=False, soft_wrap=True)
        except Exception:  # noqa: BLE001 (logging's contract: a handler never raises)
            self.handleError(record)


context = _Context()
logger = logging.getLogger("atoll")
terminal: Any = None  # the rich console of a daemon that logs text to a terminal; None otherwise


def setup_logging(level: str = "INFO", fmt: LogFormat | str = LogFormat.TEXT) -> None:
    """The ``atoll`` logger's one handler: JSON lines, or text lines; text to a terminal goes through a rich console
    (``terminal``), which the progress bars share."""
    global terminal
    terminal = None
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if LogFormat(fmt) is LogFormat.JSON:
        handler.setFormatter(JSONFormatter())
    else:
        if sys.stderr.isatty():
            from rich.console import Console

            terminal = Console(stderr=True)
            handler = _ConsoleHandler(terminal)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(peer)s step %(step)s] %(message)s",
                                               "%H:%M:%S"))
    handler.addFilter(context)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    # hivemind logs through its own handler; keep its routine chatter out of the daemon's output. In JSON its lines
    # go through ours, so that a log shipper never meets a line that is not one JSON object; on a terminal too.
    hivemind = logging.getLogger("hivemind")
    hivemind.setLevel(logging.WARNING)
    if LogFormat(fmt) is LogFormat.JSON or terminal is not None:  # on a terminal: above the bars, not through them
        hivemind.handlers[:] = [handler]
        hivemind.propagate = False
