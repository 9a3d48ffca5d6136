"""A private run lets no one in without a join token: an outsider on the run's DHT can neither write its records,
join its rounds, nor download its state, and every attempt is refused and logged. Members train as usual.

``b`` runs its DHT node in its own process (``--dht-in-process``, ``protocols/local_dht.py``), ``a`` in hivemind's
forked DHT process: the same records, validators and refusals on both, in one swarm.
"""

import asyncio

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time
from scripts.swarm import LocalSwarm, StatusReader, daemon_processes
from support.records import forged_progress
from support.swarms import assert_replicas_agree, peer_id, wait_for

from atoll.protocols.stats import TrafficStats
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import open_rounds_key, progress_key, progress_shard, round_key
from atoll.models.configs import get_model_config
from atoll.models.gpt import GPT
from atoll.protocols.state_serve import p2p_opener
from atoll.protocols.state_sync import _continue_from, _Transfer

pytestmark = pytest.mark.integration

COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("private"), COMMON)
    try:
        s.start("a", join=False)
        s.start("b", ["--dht-in-process", "true"])
        yield s
    finally:
        s.stop_all(timeout=30)


@pytest.fixture
def outsider(swarm):
    """A DHT client on the run's network, with no token: it signs its records with a key of its own."""
    validators = make_validators("atoll")
    dht = DHT(initial_peers=swarm.bootstrap, start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              record_validators=validators)
    try:
        yield dht, validators[0].local_public_key
    finally:
        dht.shutdown()


def test_members_train_together(swarm):
    a, b = swarm.daemons["a"], swarm.daemons["b"]
    wait_for(lambda: sum(len(r["contributors"]) == 2 for r in a.rounds()) >= 2, 180, "two 2-member rounds")
    assert_replicas_agree(swarm, "ab")
    assert "starting a new private run 'atoll'" in a.log()
    assert "dht" in daemon_processes(a.proc.pid) and "dht" not in daemon_processes(b.proc.pid)


def test_outsider_cannot_write_records_or_join_rounds(swarm, outsider):
    dht, subkey = outsider
    a = swarm.daemons["a"]
    me = str(dht.peer_id)
    newest = max(a.rounds(), key=lambda r: r["version"])
    version, digest = newest["version"], newest["hash"]
    # A heavier replica (it would make members download from it), a round registration for the next rounds, and an
    # open-round announcement: the members' DHT nodes refuse to store any of them.
    expiration = get_dht_time() + 60
    assert not dht.store(progress_key("atoll", progress_shard(me)), forged_progress(me, version + 50), expiration,
                         subkey=subkey)
    for v in range(version, version + 4):
        assert not dht.store(round_key("atoll", 0, v), {"peer_id": me, "weight": 1e6, "time": float(get_dht_time())},
                             expiration, subkey=subkey)
    announcement = {"peer_id": me, "fragment": 0, "version": version}
    assert not dht.store(open_rounds_key("atoll", 0, version, digest), announcement, expiration, subkey=subkey)
    for d in swarm.daemons.values():
        wait_for(lambda: "refused a DHT record of owner key" in d.log(), 30, "both to log the refused records")
    reader = StatusReader(swarm.bootstrap)
    try:
        listed = {p["peer_id"] for p in reader.read()["peers"]}
    finally:
        reader.close()
    assert peer_id(a) in listed and me not in listed
    later = version + 5
    wait_for(lambda: max(r["version"] for r in a.rounds()) >= later, 180, "a to merge five more rounds")
    for d in swarm.daemons.values():
        assert all(me not in r["members"] for r in d.rounds())
        assert me[-8:] not in d.log()  # never a donor, member or peer: its fake heavier replica was invisible


def test_outsider_cannot_download_state(swarm, outsider):
    dht, _ = outsider
    a = swarm.daemons["a"]
    numel = sum(p.numel() for p in GPT(get_model_config("nano")).parameters())  # diloco: one fragment, all of it

    async def attempt():
        p2p = await dht.replicate_p2p()
        # The stream is closed unanswered before any of it is read (protocols/p2p_guard.py): no state, no header.
        with pytest.raises(StopAsyncIteration):
            await _continue_from(p2p_opener(p2p, "atoll"), peer_id(a), 0, _Transfer(numel), 10.0, TrafficStats())

    asyncio.run(attempt())
    wait_for(lambda: "(unauthorized): not a member of this private run" in a.log(), 30, "a to log the refusal")
