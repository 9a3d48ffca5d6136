"""Compressed rounds on real daemons: int4 with error feedback keeps replicas bit-identical, and malformed parts
(truncated, wrong header, unknown codec, NaN) are rejected and logged while the round completes without them."""

import re

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import assert_replicas_agree, peer_id, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.waits]


def test_malformed_parts_are_rejected_and_replicas_still_agree(tmp_path):
    common = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20", "--compression", "int4",
              "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--harness", "step_delay=0.02",
              # A short cooldown: the corrupting daemon is left out for a few seconds after each offence, so that its
              # corrupt rounds (each kind until two reached the group) and the full rounds after them come in time.
              "--peer-cooldown", "3"]
    with LocalSwarm(tmp_path, common) as swarm:
        swarm.start("a", join=False)
        swarm.start("b")
        bad = swarm.start("bad", ["--fault", "corrupt_round=4"])
        ids = {peer_id(d) for d in swarm.daemons.values()}

        patterns = {"truncated": "truncated payload", "header": "bad magic", "codec": "unknown codec",
                    "nan": "finite"}

        def rejected() -> list[str]:
            logs = swarm.daemons["a"].log() + swarm.daemons["b"].log()
            return re.findall(r"rejected aggregate part from \w+: undecodable part: (.*)", logs)

        wait_for(lambda: all(any(pat in r for r in rejected()) for pat in patterns.values()), 240,
                 f"a peer rejecting each kind of malformed part: {patterns}")
        wait_for(lambda: "valid parts from now on" in bad.log(), 240, "the end of the fault schedule")
        last_bad = max(int(v) for v in re.findall(r"sending \w+ parts in round f\d+ v(\d+)", bad.log()))

        def full_rounds_after_fault():
            return [r for r in swarm.daemons["a"].rounds()
                    if set(r["contributors"]) == ids and r["version"] > last_bad + 1]

        wait_for(lambda: len(full_rounds_after_fault()) >= 2, 240, "rounds with all three after the corrupt ones")
        for kind in patterns:
            assert f"sending {kind} parts" in bad.log()
        assert re.search(r"peer \w+ sent a rejected (codec|nonfinite): left out of rounds",
                         swarm.daemons["a"].log() + swarm.daemons["b"].log())
        assert_replicas_agree(swarm, ("a", "b", "bad"))
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
