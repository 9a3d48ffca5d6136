"""Compressed rounds on real daemons: int4 with error feedback keeps replicas bit-identical, and malformed parts
(truncated, wrong header, unknown codec, NaN) are rejected and logged while the round completes without them."""

import re

import pytest
from swarm import LocalSwarm
from test_swarm import assert_replicas_agree, peer_id, wait_for

pytestmark = pytest.mark.integration


def test_malformed_parts_are_rejected_and_replicas_still_agree(tmp_path):
    common = ["--model", "nano", "--batch-size", "4", "--sync-every", "20", "--compression", "int4",
              "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--fault", "step_delay=0.02"]
    with LocalSwarm(tmp_path, common) as swarm:
        swarm.start("a", join=False)
        swarm.start("b")
        bad = swarm.start("bad", ["--fault", "corrupt_round=4"])
        ids = {peer_id(d) for d in swarm.daemons.values()}

        def full_rounds_after_fault():
            return [r for r in swarm.daemons["a"].rounds() if set(r["contributors"]) == ids
                    and "sending nan parts" in bad.log()]

        wait_for(lambda: len(full_rounds_after_fault()) >= 2, 240, "rounds with all three after the corrupt ones")
        logs = swarm.daemons["a"].log() + swarm.daemons["b"].log()
        for kind in ("truncated", "header", "codec", "nan"):
            assert f"sending {kind} parts" in bad.log()
        rejected = re.findall(r"rejected aggregate part from \w+: undecodable part: (.*)", logs)
        assert len(rejected) >= 4, rejected
        assert any("NaN" in r or "non-finite" in r.lower() or "nan" in r.lower() for r in rejected), rejected
        assert_replicas_agree(swarm, ("a", "b", "bad"))
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
