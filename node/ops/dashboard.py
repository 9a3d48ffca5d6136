"""``atoll dashboard``: one web page of a run, served by a DHT client of its own.

What it reads: what ``atoll status`` reads (``node/ops/status.py``), which is what anyone who reaches the run's DHT may
read (docs/security.md, "What an outsider may read"). It holds no join token, so it works the same for an open and
a private run, and it can show nothing a member keeps to the members (models, deltas, data paths).

Where its history comes from: its own polling. The daemons publish only their newest figures; the dashboard keeps
every poll's figures (``History``, ``node/ops/history.py``), bounded, so its curves begin when it started.

The page (``node/ops/dashboard_page.py``) fetches ``/api/state`` from the same address and draws it in inline SVG: it
requests nothing from anywhere else, and its Content-Security-Policy forbids it to."""

from __future__ import annotations

import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from ..checks import ConfigError
from .history import HISTORY_POINTS, History

logger = logging.getLogger(__name__)

POLL_EVERY = 5.0  # seconds between two reads of the run
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def respond(path: str, history: History, interval: float) -> tuple[int, str, bytes]:
    """The answer to a GET of ``path``: (HTTP status, content type, body). ``/`` is the page, ``/api/state`` the
    history's view (with the poll interval, which the page refreshes at), ``/healthz`` a liveness probe."""
    from .dashboard_page import PAGE

    if path == "/":
        return 200, "text/html; charset=utf-8", PAGE.encode()
    if path == "/api/state":
        state = {**history.view(), "interval": interval}
        return 200, "application/json", json.dumps(state, allow_nan=False).encode()
    if path == "/healthz":
        return 200, "text/plain; charset=utf-8", b"ok\n"
    return 404, "text/plain; charset=utf-8", b"not found\n"


def host_allowed(header: str | None, bound: str) -> bool:
    """Whether a request's ``Host`` header may be answered by a server bound to ``bound``. Bound to loopback, only a
    loopback name: a web page the operator visits elsewhere could otherwise point a name of its own at 127.0.0.1
    (DNS rebinding) and read the run from the operator's browser. Bound to another address, any (the operator
    chose to serve others, under names this server cannot know)."""
    if bound not in LOOPBACK:
        return True
    if not header:
        return False
    name = urlsplit(f"//{header}").hostname
    return name in LOOPBACK


class _Handler(BaseHTTPRequestHandler):
    """GET only: the page, its state, the liveness probe; every answer uncached, under the page's CSP."""

    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        from .dashboard_page import CSP

        if host_allowed(self.headers.get("Host"), self.server.host):
            status, ctype, body = respond(urlsplit(self.path).path, self.server.history, self.server.interval)
        else:
            status, ctype, body = 403, "text/plain; charset=utf-8", b"this dashboard answers to loopback names only\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:  # every request would be a line otherwise
        logger.debug("%s %s", self.address_string(), fmt % args)


class _Server(ThreadingHTTPServer):
    """The page's HTTP server: one thread a request, none of which outlives the process."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], history: History, interval: float) -> None:
        super().__init__(address, _Handler)
        self.host, self.history, self.interval = address[0], history, interval


def serve(host: str, port: int, history: History, interval: float) -> _Server:
    """Listen on ``host:port`` (0: a free port) and serve the page on a thread of its own; ``ConfigError`` if the
    address cannot be bound. ``server.shutdown()`` and ``server.server_close()`` stop it."""
    try:
        server = _Server((host, port), history, interval)
    except OSError as e:
        raise ConfigError(f"port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    threading.Thread(target=server.serve_forever, name="dashboard-http", daemon=True).start()
    return server


def poll(read: Callable[[], dict[str, Any]], history: History, interval: float, stop: threading.Event) -> None:
    """Read the run every ``interval`` seconds into ``history`` until ``stop`` is set. A failed read is one warning
    line and the page's error; the next read goes on."""
    while not stop.is_set():
        try:
            doc = read()
        except Exception as e:  # noqa: BLE001 (a DHT timeout, a peer gone: the dashboard outlives it)
            logger.warning("reading the run failed: %s", e)
            history.failed(f"reading the run failed: {e}")
        else:
            if doc["config"] is None and not doc["peers"] and not doc["summary"]["summarizers"]:
                history.failed(f"no run {doc['run_id']!r} found yet")  # a typo in --run-id, or not started yet
            else:
                history.add(doc)
        stop.wait(interval)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_dashboard(initial_peers: list[str], run_id: str, host: str, port: int, interval: float = POLL_EVERY,
                  points: int = HISTORY_POINTS, join_token: str | None = None, run_key: str | None = None) -> int:
    """``atoll dashboard``: serve the page on ``host:port`` and read the run every ``interval`` seconds through one
    DHT client, until Ctrl-C (exit 0)."""
    from .reader import check_target, open_reader
    from .status import collect_status, reader_validators

    if not interval > 0:
        raise ConfigError(f"interval: must be positive, got {interval}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"port: must be in 0..65535, got {port}")
    if points < 4:
        raise ConfigError(f"history: must be at least 4 points, got {points}")
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    check_target(run_id, initial_peers)
    validators, verified = reader_validators(run_id, join_token, run_key)  # a bad token: exit 2 before serving
    history = History(points)
    server = serve(host, port, history, interval)  # before the DHT: a taken port fails at once
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop ends it as Ctrl-C does: DHT children too
    dht = None
    try:
        dht = open_reader(run_id, initial_peers, validators)
        print(f"dashboard of run {run_id!r} at http://{host}:{server.server_port}/ (Ctrl-C ends it)", flush=True)
        poll(lambda: collect_status(dht, run_id, verified=verified), history, interval, threading.Event())
    except KeyboardInterrupt:  # while joining, too: a dead bootstrap peer must not make Ctrl-C a traceback
        pass
    finally:
        # A second Ctrl-C while the DHT's children stop would leave p2pd behind: the shutdown goes to its end.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if dht is not None:
            dht.shutdown()
        server.shutdown()
        server.server_close()
    return 0
