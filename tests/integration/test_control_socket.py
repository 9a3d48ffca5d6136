"""The daemon's local control socket (a Unix socket, node/island/control.py) and ``atoll pause``/``atoll resume``
against it, with a stand-in for the training loop: owner-only, one live daemon per socket, a stale socket replaced,
and the CLI's lines and exit codes."""

import os
import stat
import threading

import pytest

from atoll.node.cli import main
from atoll.node.config import ConfigError
from atoll.node.island.control import ControlServer, ask, run_control
from atoll.node.island.pause import OPERATOR, PauseState

pytestmark = [pytest.mark.integration, pytest.mark.waits]


class Loop:
    """Carries out the operator's requests as the daemon's loop does, between steps."""

    def __init__(self, state: PauseState) -> None:
        self.state, self.stop = state, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            self.state.paused = bool(self.state.reasons())
            self.state.step += 0 if self.state.paused else 1
            self.state.changed.wait(0.05)
            self.state.changed.clear()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture
def daemon(tmp_path):
    state = PauseState([])
    server = ControlServer(str(tmp_path / "control.sock"), state, lambda: {"freed_mib": 12.5})
    loop = Loop(state)
    yield server, state
    loop.close()
    server.stop()


def test_socket_is_owner_only_and_answers_state(daemon):
    server, state = daemon
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    answer = ask(server.path, "state")
    assert answer["paused"] is False and answer["reasons"] == []


def test_pause_and_resume_through_the_cli(daemon, tmp_path, capsys):
    server, state = daemon
    assert main(["pause", "--checkpoint-dir", str(tmp_path), "--wait", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("paused at step ") and "(operator); freed 12.5 MiB" in out, out
    assert state.paused and state.holding() == [OPERATOR]
    assert main(["resume", "--control-socket", server.path, "--wait", "10"]) == 0
    assert capsys.readouterr().out.startswith("training at step ")
    assert not state.paused


def test_resume_says_which_policy_still_holds(tmp_path, capsys):
    class Holds:
        name = "file:/x"

        def holds(self):
            return True

        def close(self):
            pass

    state = PauseState([Holds()])
    server = ControlServer(str(tmp_path / "c.sock"), state)
    loop = Loop(state)
    try:
        assert run_control("pause", server.path, 10) == 0
        assert run_control("resume", server.path, 10) == 0
        assert "still paused" in capsys.readouterr().out.splitlines()[-1]
        assert state.paused and not state.operator
    finally:
        loop.close()
        server.stop()


def test_one_daemon_per_socket_and_a_stale_one_is_replaced(daemon, tmp_path):
    server, _ = daemon
    with pytest.raises(ConfigError, match="another daemon listens"):
        ControlServer(server.path, PauseState([]))
    stale = tmp_path / "stale.sock"
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # a crashed daemon's socket file: nobody listens
    ControlServer(str(stale), PauseState([])).stop()
    assert not stale.exists()


def test_no_daemon_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["pause", "--checkpoint-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no daemon listens on" in err, err
    assert main(["resume"]) == 2
    assert "give the daemon's --checkpoint-dir" in capsys.readouterr().err


def test_a_refusing_daemon_says_why(daemon, capsys):
    server, state = daemon
    server.refusal = "a member of a ddp run cannot pause (its membership is fixed)"
    assert main(["pause", "--control-socket", server.path]) == 2
    assert "ddp run cannot pause" in capsys.readouterr().err
    assert not state.operator


def test_a_file_in_the_way_is_refused_and_kept(tmp_path):
    path = tmp_path / "control.sock"
    path.write_text("not a socket")
    with pytest.raises(ConfigError, match="is not a socket"):
        ControlServer(str(path), PauseState([]))
    assert path.read_text() == "not a socket"


def test_a_hostile_request_does_not_end_the_socket(daemon):
    import socket

    server, state = daemon
    for junk in (b"[" * 1000 + b"\n", b"\xff\xfe\n", b'{"op": 3}\n', b"\n"):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            s.sendall(junk)
            s.recv(1024)
    assert ask(server.path, "pause")["operator"] is True
