"""A hostile member of a private run (one valid join token) cannot multiply itself in the DHT, and a revoked member
is out: its records are refused, it leaves the others' peer tables and rounds within seconds, and they keep
training."""

import subprocess
import sys
import time

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time
from scripts.swarm import LocalSwarm, StatusReader
from support.records import forged_progress
from support.swarms import peer_id, wait_for

from atoll.protocols.auth import JoinToken
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import progress_key, progress_shard

pytestmark = pytest.mark.integration

COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1"]
REVOKE_BOUND = 30.0  # seconds: the daemons read the revocation list every 5 s and their peer tables every heartbeat


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("revocation"), COMMON)
    try:
        s.start("a", join=False)
        s.start("b")
        s.start("c")
        yield s
    finally:
        s.stop_all(timeout=30)


def test_peer_ids_are_member_keys(swarm):
    for name in "bc":
        token = JoinToken.load(swarm.root / name / "join.token")
        assert peer_id(swarm.daemons[name]) == token.member_key.peer_id


def test_a_member_cannot_store_records_for_fake_peers(swarm, tmp_path):
    """The review's attack: one token, 50 progress records with fake peer ids (extra subkey bytes), 10-year expiry."""
    from atoll.protocols.auth import RunKey

    mallory = RunKey.load(swarm.run_key).issue_token("atoll")
    validators = make_validators("atoll", mallory)
    owner = validators[0].local_public_key
    dht = DHT(initial_peers=swarm.bootstrap, start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              record_validators=validators)
    fakes = [f"QmFake{i:040d}" for i in range(20)]
    try:
        for i, fake in enumerate(fakes):
            for subkey, ttl in ((owner + b"%d" % i, 60), (owner, 60), (owner, 10 * 365 * 24 * 3600)):
                assert not dht.store(progress_key("atoll", progress_shard(fake)), forged_progress(fake, 1),
                                     get_dht_time() + ttl, subkey=subkey)
        mine = mallory.member_key.peer_id
        assert not dht.store(progress_key("atoll", progress_shard(mine)), forged_progress(mine, 1),
                             get_dht_time() + 10 * 365 * 24 * 3600, subkey=owner)  # its own peer id, for ten years
    finally:
        dht.shutdown()
    reader = StatusReader(swarm.bootstrap)
    try:
        listed = {p["peer_id"] for p in reader.read()["peers"]}
    finally:
        reader.close()
    assert not listed & set(fakes) and mine not in listed
    assert peer_id(swarm.daemons["a"]) in listed


def test_a_revoked_member_is_refused_and_the_others_keep_training(swarm):
    a, b, c = (swarm.daemons[n] for n in "abc")
    c_id = peer_id(c)
    wait_for(lambda: any(c_id in r["members"] for r in a.rounds()), 300, "c to take part in a round of a")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "atoll.node.cli", "token", "revoke", "--run-key", str(swarm.run_key),
                          "--token", str(swarm.root / "c" / "join.token"), "--initial-peers", *swarm.bootstrap],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "revocation list 1 of run 'atoll': 1 member(s) revoked" in out.stdout
    for d in (a, b):
        wait_for(lambda d=d: "revocation list 1 of the run: 1 member(s) revoked" in d.log(), REVOKE_BOUND,
                 f"{d.name} to apply the revocation")
    bound = time.monotonic() - t0
    rounds_then = {d.name: len(d.rounds()) for d in (a, b)}
    # c keeps heartbeating; the others' DHT nodes refuse its records from now on (counted, logged once a minute).
    wait_for(lambda: "(dht_revoked)" in a.log() + b.log(), 60, "a or b to refuse a record of the revoked member")
    # The others keep training together, without c: every round they start from now on leaves it out.
    wait_for(lambda: all(sum(len(r["contributors"]) == 2 for r in d.rounds()[rounds_then[d.name] + 1:]) >= 2
                         for d in (a, b)), 300, "a and b to merge two more 2-member rounds")
    for d in (a, b):
        later = d.rounds()[rounds_then[d.name] + 1:]
        assert later and all(c_id not in r["members"] for r in later)
        assert "Traceback" not in d.log()
    # c reads the list at its own pace (every 5 s), not when a and b have applied it: wait for it, within the bound.
    wait_for(lambda: "this daemon's membership was revoked by the run key" in c.log(), REVOKE_BOUND,
             "c to learn that its membership was revoked")
    assert a.alive() and b.alive()
    # A restarted member keeps the list (its checkpoint dir), and the revoked token cannot come back in.
    assert (swarm.root / "a" / "revoked.list").exists() and (swarm.root / "b" / "revoked.list").exists()
    print(f"revocation applied by a and b within {bound:.1f} s")
