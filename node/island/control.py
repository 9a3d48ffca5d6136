"""The daemon's local control socket, and ``atoll pause`` / ``atoll resume``, its client.

A Unix socket (``--control-socket``; default ``<checkpoint-dir>/control.sock``) made readable and writable by its
owner only, which also refuses a connection from any other user but root (``SO_PEERCRED``): only the operator of
the machine controls the daemon, and nothing of it is reachable from the network. One request per connection, one
JSON line each way::

    {"op": "pause"} | {"op": "resume"} | {"op": "state"}  ->  {"paused": bool, "reasons": [...], "step": N, ...}

The socket only records what the operator asked (``PauseState.request``); the training loop carries it out at its
next step boundary, and ``atoll pause`` waits until it did.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from typing import Any

from ..config import ConfigError, check_socket_path
from .pause import PauseState

logger = logging.getLogger("atoll")
MAX_REQUEST = 1024
MAX_ANSWER = 1 << 20
class ControlServer:
    """Serves ``state`` on ``path`` until ``stop()``; refuses to start over another live daemon's socket."""

    def __init__(self, path: str, state: PauseState, extra: Any = None) -> None:
        check_socket_path(path)
        self.path, self.state, self.extra = path, state, extra or (lambda: {})
        self.refusal: str | None = None  # why this daemon cannot pause, if it cannot
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise ConfigError(f"control_socket: {path} exists and is not a socket; give another "
                                  "--control-socket")
            if _answers(path):
                raise ConfigError(f"control_socket: another daemon listens on {path}; give each daemon its own "
                                  "--checkpoint-dir or --control-socket")
            try:
                os.unlink(path)  # left by a daemon that crashed
            except OSError as e:
                raise ConfigError(f"control_socket: cannot replace the stale {path}: {e.strerror}") from None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created owner-only: no moment at which another user may connect
        try:
            self.sock.bind(path)
        except OSError as e:
            raise ConfigError(f"control_socket: cannot listen on {path}: {e.strerror}") from None
        finally:
            os.umask(old)
        self.sock.listen(8)
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="atoll-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2.0)
                    self._answer(conn)
                except Exception as e:  # noqa: BLE001 — no request may end the socket's thread
                    logger.warning("control socket: a bad request (%s)", type(e).__name__)

    def _answer(self, conn: socket.socket) -> None:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[2]
        if uid not in (os.getuid(), 0):
            logger.warning("control socket: refused a request from uid %d", uid)
            return
        request = json.loads(_read_line(conn, MAX_REQUEST).decode() or "null")
        op = request.get("op") if isinstance(request, dict) else None
        if op in ("pause", "resume") and self.refusal:
            _send(conn, {"error": self.refusal})
            return
        if op == "pause":
            if not self.state.operator:
                logger.info("the operator asked to pause (atoll pause)")
            self.state.request(True)
        elif op == "resume":
            if self.state.operator:
                logger.info("the operator asked to resume (atoll resume)")
            self.state.request(False)
        elif op != "state":
            _send(conn, {"error": f"unknown op {op!r}"})
            return
        _send(conn, self.state_doc())

    def state_doc(self) -> dict[str, Any]:
        s = self.state
        return {"paused": s.paused, "operator": s.operator, "reasons": s.holding(), "step": s.step, **self.extra()}

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _send(conn: socket.socket, doc: dict[str, Any]) -> None:
    conn.sendall(json.dumps(doc).encode() + b"\n")


def _read_line(conn: socket.socket, limit: int) -> bytes:
    """Bytes up to a newline, the peer's close, or just past ``limit``."""
    data = b""
    while not data.endswith(b"\n") and len(data) <= limit:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(path)
        return True
    except OSError:
        return False


def ask(path: str, op: str, timeout: float = 10.0) -> dict[str, Any]:
    """One request to the daemon listening on ``path``; ``ConfigError`` when none does."""
    check_socket_path(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            _send(s, {"op": op})
            data = _read_line(s, MAX_ANSWER)
    except FileNotFoundError:
        raise ConfigError(f"control_socket: no daemon listens on {path} (is it running, with this "
                          "--checkpoint-dir?)") from None
    except OSError as e:
        raise ConfigError(f"control_socket: cannot reach the daemon on {path}: {e.strerror or e}") from None
    try:
        answer = json.loads(data.decode())
    except ValueError:
        raise ConfigError(f"control_socket: the daemon on {path} gave no answer (it may be leaving)") from None
    if "error" in answer:
        raise ConfigError(f"control_socket: {answer['error']}")
    return answer


def socket_path(control_socket: str | None, checkpoint_dir: str | None) -> str:
    """The socket ``atoll pause``/``resume`` talk to: the one given, else the checkpoint directory's."""
    if control_socket:
        return control_socket
    if checkpoint_dir:
        return os.path.join(checkpoint_dir, "control.sock")
    raise ConfigError("control_socket: give the daemon's --checkpoint-dir (or its --control-socket)")


def run_control(op: str, path: str, wait: float) -> int:
    """``atoll pause`` / ``atoll resume``: ask, then wait up to ``wait`` seconds until the daemon did it; print one
    line. Exit 0 once done (or asked, with ``wait`` 0), 1 if it did not happen in time, 2 when no daemon answers."""
    answer = ask(path, op)
    if wait <= 0:
        print(describe(answer, op))
        return 0
    want = op == "pause"
    deadline = time.monotonic() + wait
    while answer["paused"] != want and time.monotonic() < deadline:
        if not want and answer["reasons"]:  # the operator's pause is lifted; a policy still holds
            break
        time.sleep(0.5)
        answer = ask(path, "state")
    print(describe(answer, op))
    done = answer["paused"] == want or (not want and bool(answer["reasons"]))
    return 0 if done else 1


def describe(answer: dict[str, Any], op: str = "state") -> str:
    """One line for the operator: what the daemon does now, in answer to ``op``."""
    reasons = ", ".join(answer["reasons"])
    if answer["paused"] and op == "resume" and reasons:
        return f"still paused at step {answer['step']}: {reasons} holds"
    if answer["paused"]:
        freed = answer.get("freed_mib")
        held = f"; freed {freed:.1f} MiB of model and optimizer state" if freed is not None else ""
        return f"paused at step {answer['step']} ({reasons or 'resuming'}){held}"
    if reasons:
        return f"training at step {answer['step']}; pausing at the next step ({reasons})"
    return f"training at step {answer['step']}"
