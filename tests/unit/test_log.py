"""The daemon's log lines: text that names the peer and the step, or one JSON object a line for log shippers."""

import json
import logging

import pytest

from atoll.node import log
from atoll.node.config import ConfigError, NodeConfig


@pytest.fixture
def restore_logging():
    log.context.peer_id, log.context.step = "", 0
    hivemind = logging.getLogger("hivemind")
    handlers = list(hivemind.handlers)
    yield
    log.context.peer_id, log.context.step = "", 0
    log.setup_logging("INFO")
    hivemind.handlers[:] = handlers


def test_json_lines_carry_the_peer_id_and_the_step_as_fields(capsys, restore_logging):
    log.setup_logging("INFO", "json")
    log.logger.info("before the daemon has a peer id")
    log.context.peer_id, log.context.step = "QmTestPeer12345678", 640
    log.logger.warning("round f0 v31 failed; continuing with \"local\" progress")
    try:
        raise ValueError("boom")
    except ValueError:
        log.logger.exception("a round ended with an error")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(d["level"], d["peer_id"], d["step"]) for d in lines] == [
        ("INFO", None, 0), (logging.getLevelName(logging.WARNING), "QmTestPeer12345678", 640),
        ("ERROR", "QmTestPeer12345678", 640)]
    assert lines[1]["message"] == 'round f0 v31 failed; continuing with "local" progress'
    assert "ValueError: boom" in lines[2]["exception"]
    logging.getLogger("hivemind.dht").warning("a hivemind warning")  # through our handler too
    (line,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert line["message"] == "a hivemind warning" and line["peer_id"] == "QmTestPeer12345678"
    assert all(d["time"].endswith("Z") and "T" in d["time"] for d in lines)


def test_text_lines_name_the_short_peer_id_and_the_step(capsys, restore_logging):
    log.setup_logging("INFO")
    log.context.peer_id, log.context.step = "QmTestPeer12345678", 7
    log.logger.info("hello")
    assert capsys.readouterr().err.rstrip().endswith("INFO [12345678 step 7] hello")
    assert logging.getLogger("hivemind").level == logging.WARNING


def test_an_unknown_log_format_is_a_config_error():
    with pytest.raises(ConfigError, match="log_format"):
        NodeConfig(log_format="xml").validate()
