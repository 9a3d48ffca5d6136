"""``atoll dashboard``: one web page of a run, served by a DHT client of its own.

What it reads: what ``atoll status`` reads (``node/status.py``), which is what anyone who reaches the run's DHT may
read (docs/security.md, "What an outsider may read"). It holds no join token, so it works the same for an open and
a private run, and it can show nothing a member keeps to the members (models, deltas, data paths).

Where its history comes from: its own polling. The daemons publish only their newest figures; the dashboard keeps
every poll's figures (``History``), bounded by thinning, so its curves begin when it started.

The page (``node/dashboard_page.py``) fetches ``/api/state`` from the same address and draws it in inline SVG: it
requests nothing from anywhere else, and its Content-Security-Policy forbids it to."""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from .config import ConfigError
from .curves import smoothed, thin

logger = logging.getLogger(__name__)

POLL_EVERY = 5.0  # seconds between two reads of the run
HISTORY_POINTS = 2000  # points kept per series (``curves.thin``)
SMOOTHING = 0.9  # the training loss's moving-average weight (``curves.smoothed``)
# Counters summed over the islands for the run's series; the first three are in every summary as well.
RUN_COUNTERS = ("tokens", "bytes_sent", "bytes_received", "rounds", "rounds_skipped", "rejected", "forks_healed")
# The page may load nothing but itself and fetch nothing but this server's /api/state.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _finite(x: Any) -> float | None:
    """``x`` as a float when it is a finite number (a record from the network may carry anything JSON allows)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


@dataclass
class _Island:
    loss: list[tuple[float, int, float]] = field(default_factory=list)  # (time, step, training loss)
    held_out: list[tuple[float, int, float]] = field(default_factory=list)  # (time, step, held-out loss)
    record: dict[str, Any] = field(default_factory=dict)  # its newest record
    seen: tuple[float, int] | None = None  # (time, step) of the newest read of it
    version_grew_at: float | None = None  # when this dashboard saw its replica's version grow


class History:
    """What the dashboard has polled: each island's training loss and held-out evaluations over time, and the run's
    counters over time. Every series keeps at most ``points`` points (``curves.thin``).

    A training-loss point is added when an island's step moved since its last one (a record republished at the same
    step adds nothing); a held-out point only when its ``held_out_step`` is new, so an evaluation is drawn once,
    where it happened, and a figure repeated by later records is not. The run's counters are summed over every
    island this dashboard has seen, each at its newest record: an island that left still counts what it did."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.points = points
        self.islands: dict[str, _Island] = {}
        self.run: list[tuple[float, dict[str, float]]] = []  # (time, {counter: value, "version": newest version})
        self.doc: dict[str, Any] | None = None  # the newest status document
        self.polls = 0
        self.first_poll: float | None = None
        self.error: str | None = None  # why the newest poll failed; None when it did not
        self._lock = threading.Lock()

    def add(self, doc: dict[str, Any]) -> None:
        """One poll's status document (``status.collect_status``)."""
        with self._lock:
            t = doc["time"]
            self.doc, self.error = doc, None
            self.polls += 1
            self.first_poll = t if self.first_poll is None else self.first_poll
            for rec in doc["peers"] or []:
                self._add_record(t, rec)
            if doc["peers"] is not None:
                sums = {k: float(sum(_finite(i.record.get(k)) or 0.0 for i in self.islands.values()))
                        for k in RUN_COUNTERS}
            else:  # a large run, read from its summaries: only what they total
                sums = {k: float(doc["totals"][k]) for k in ("tokens", "bytes_sent", "bytes_received")}
            sums["version"] = float(doc["totals"]["max_version"])
            self.run = thin(self.run + [(t, sums)], self.points)

    def _add_record(self, t: float, rec: dict[str, Any]) -> None:
        island = self.islands.setdefault(rec["peer_id"], _Island())
        step, loss = rec["step"], _finite(rec.get("loss"))
        held_out, at = _finite(rec.get("held_out_loss")), rec.get("held_out_step")
        if held_out is not None and at is not None and (not island.held_out or island.held_out[-1][1] != at):
            when = _time_at_step(island, at, t, step)
            if when is not None:
                island.held_out = thin(island.held_out + [(when, at, held_out)], self.points)
        if loss is not None and (not island.loss or island.loss[-1][1] != step):
            island.loss = thin(island.loss + [(t, step, loss)], self.points)
        island.seen = (t, step)
        if island.record and rec["version"] > island.record["version"]:
            island.version_grew_at = t
        island.record = rec

    def failed(self, why: str) -> None:
        """The newest poll failed (``why``: one line); the page says so, and keeps what it has."""
        with self._lock:
            self.error = why

    def view(self, now: float | None = None) -> dict[str, Any]:
        """The page's state as one JSON-ready document: the run (id, config, totals, where they come from), the
        islands of the newest poll with the seconds since this dashboard saw each one's replica version grow, each
        island's training loss (raw and ``smoothed``) and held-out evaluations, and the run's counters over time."""
        now = time.time() if now is None else now
        with self._lock:
            doc = self.doc or {}
            listed = [r["peer_id"] for r in doc.get("peers") or []]
            islands = []
            for pid in listed:
                island = self.islands[pid]
                grew = island.version_grew_at
                islands.append({**island.record, "last_round_s": None if grew is None else max(0.0, now - grew)})
            seen = sorted(self.islands)
            return {
                "run_id": doc.get("run_id"), "time": doc.get("time"), "now": now, "polls": self.polls,
                "first_poll": self.first_poll, "error": self.error, "config": doc.get("config"),
                "totals": doc.get("totals"), "summary": doc.get("summary"), "islands": islands, "seen": seen,
                "loss": [{"peer_id": pid, "t": [p[0] for p in self.islands[pid].loss],
                          "step": [p[1] for p in self.islands[pid].loss], "raw": [p[2] for p in self.islands[pid].loss],
                          "smooth": smoothed([p[2] for p in self.islands[pid].loss], SMOOTHING)} for pid in seen],
                "held_out": [{"peer_id": pid, "t": [p[0] for p in self.islands[pid].held_out],
                              "step": [p[1] for p in self.islands[pid].held_out],
                              "value": [p[2] for p in self.islands[pid].held_out]} for pid in seen],
                "run": {"t": [t for t, _ in self.run],
                        **{k: [s.get(k) for _, s in self.run] for k in (*RUN_COUNTERS, "version")}},
            }


def _time_at_step(island: _Island, at: int, t: float, step: int) -> float | None:
    """When ``island``, now (``t``) at ``step``, was at step ``at``: linear between the two reads around it (each
    step at the newest read that found the island there). None when it was there before this dashboard's first read
    of it: an evaluation is drawn where it happened, or not at all."""
    seen = [(p[0], p[1]) for p in island.loss]
    if island.seen is not None:
        if seen and seen[-1][1] == island.seen[1]:
            seen[-1] = island.seen  # still at that step at a later read
        else:
            seen.append(island.seen)
    seen.append((t, step))
    if not seen[0][1] <= at <= seen[-1][1]:
        return None if at < seen[0][1] else t
    for (t0, s0), (t1, s1) in zip(seen, seen[1:]):
        if s0 <= at <= s1:
            return t0 if s1 == s0 else t0 + (t1 - t0) * (at - s0) / (s1 - s0)
    return t  # steps went back (a restart from a checkpoint): the newest time


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


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, ctype, body = respond(urlsplit(self.path).path, self.server.history, self.server.interval)
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
    daemon_threads = True

    def __init__(self, address: tuple[str, int], history: History, interval: float) -> None:
        super().__init__(address, _Handler)
        self.history, self.interval = history, interval


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
                  points: int = HISTORY_POINTS) -> int:
    """``atoll dashboard``: serve the page on ``host:port`` and read the run every ``interval`` seconds through one
    DHT client, until Ctrl-C (exit 0)."""
    from atoll.protocols.records import make_validators

    from .config import NodeConfig
    from .join import start_dht
    from .status import collect_status

    if not interval > 0:
        raise ConfigError(f"interval: must be positive, got {interval}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"port: must be in 0..65535, got {port}")
    if points < 4:
        raise ConfigError(f"history: must be at least 4 points, got {points}")
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    cfg = NodeConfig(run_id=run_id, initial_peers=tuple(initial_peers), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    cfg.validate()
    history = History(points)
    server = serve(host, port, history, interval)  # before the DHT: a taken port fails at once
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop ends it as Ctrl-C does: DHT children too
    try:
        dht = start_dht(cfg, list(make_validators(run_id)), client_mode=True)
        try:
            print(f"dashboard of run {run_id!r} at http://{host}:{server.server_port}/ (Ctrl-C ends it)", flush=True)
            poll(lambda: collect_status(dht, run_id), history, interval, threading.Event())
        except KeyboardInterrupt:
            return 0
        finally:
            dht.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    return 0
