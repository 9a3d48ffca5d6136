"""A hostile member and an outsider attack a live private swarm; the honest daemons train as if they were absent.

Two swarms of three honest daemons, side by side, the same in every respect but the attacks (synchronous
DiLoCo, nano, H=10, a fixed number of steps, started together: the run is deterministic, so the comparison is
exact rather than statistical). In the attacked one, an outsider without a token (``scripts/hostile/outsider.py``)
first sends a frame declaring 1 GiB, opens 1,400 idle streams and sends throwaway identities to wait for groups;
then a member holding a valid join token (``scripts/hostile/member.py``, a process of its own) stores junk
records (fifty fake identities, malformed round values, a hijacked run config), claims a fake heavier all-zero
replica (serving it, then refusing to), forges round registrations and group decisions, and answers as a hostile
reducer. The honest daemons must merge every round with each other, never adopt the fake replica or the forged
config, end with identical replicas, stay within 2% of the held-out loss of the swarm without the attacks, count
the offences by kind, and stay under a memory and fd bound.
"""

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hivemind import DHT
from scripts.hostile import outsider
from scripts.swarm import LocalSwarm
from support.swarms import peer_id, wait_for

from atoll.node.rounds.join import choose_config
from atoll.protocols import dht_io
from atoll.protocols.auth import JoinToken, RunKey
from atoll.protocols.identity import MemberKey
from atoll.protocols.p2p_guard import MAX_STRANGER_STREAMS, MAX_STREAMS_PER_PEER
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import config_key, unwrap_subkeys

pytestmark = [pytest.mark.integration, pytest.mark.waits]
ROOT = Path(__file__).resolve().parents[2]

STEPS = 800  # long enough for the member's phases and the outsider's attacks to meet a training swarm
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "10",
          "--max-steps", str(STEPS), "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1",
          "--harness", "step_delay=0.1", "--eval-budget", "1",
          # A short cooldown: an offence in one attack must not hide the member from the next one's defence.
          "--peer-cooldown", "5"]
HONEST = ("a", "b", "c")
# forged_rounds: its second half (forged decisions) must outlast the cooldown its first half earns (absurd times:
# round_record_time offences, then --peer-cooldown 5 s during which its decisions are ignored uncounted).
# hostile_reducer: the cooldown its last offences earned (5 s) passes first, then it must be in some group.
PHASES = (("fake_heavier", 10.0), ("refuse", 6.0), ("forged_rounds", 24.0), ("hostile_reducer", 20.0))


def tree_usage(pid: int) -> tuple[int, int]:
    """Resident bytes and open fds of a process and its descendants (the daemon, its DHT process and p2pd)."""
    rss = fds = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            rss += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
            fds += len(os.listdir(f"/proc/{p}/fd"))
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return rss, fds


def run(root: Path, credentials: Path, attack: bool) -> dict:
    """One swarm; returns what the comparison needs. Both swarms use the same ``credentials`` (run key, a's
    identity, b's and c's tokens), so the same peer ids read the same data shards."""
    with LocalSwarm(root, COMMON) as swarm:
        together = ["--harness", f"start_together={len(HONEST)}"]
        swarm.start("a", [*together, "--run-key", str(credentials / "run.key"), "--identity",
                          str(credentials / "a.key")], join=False)
        for name in HONEST[1:]:
            swarm.start(name, [*together, "--join-token", str(credentials / f"{name}.token")])
        a = swarm.daemons["a"]
        wait_for(lambda: a.rounds(), 180, "a first round")
        observed: dict = {}
        started = time.monotonic()
        if attack:
            # A member, as a process of its own, from a's first round on: its phases need the honest daemons still
            # training (STEPS bounds their run), so they come first, and the outsider's attacks run meanwhile.
            key = RunKey.load(credentials / "run.key")
            token = root / "hostile.token"
            key.issue_token("atoll").save(token)
            result = root / "hostile.json"
            cmd = [sys.executable, "-m", "scripts.hostile.member", "--initial-peers", *swarm.bootstrap,
                   "--token", str(token), "--out", str(result), "--algorithm", "diloco", "junk_records",
                   *(f"{name}={seconds}" for name, seconds in PHASES)]
            with open(root / "hostile.log", "wb") as log:
                member = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          cwd=ROOT)
            try:
                read = lambda: json.loads(result.read_text()) if result.exists() else {"done": []}  # noqa: E731
                # An outsider, without a token, at a.
                me, maddr, pid = peer_id(a), a.maddrs[0], a.proc.pid
                observed["outsider"] = {
                    "frame": asyncio.run(outsider.oversized_frame(
                        maddr, me, outsider.handler("atoll", outsider.AGGREGATE), sample=lambda: tree_usage(pid)[0])),
                    "idle": asyncio.run(outsider.idle_streams(
                        maddr, me, outsider.handler("atoll", outsider.DOWNLOAD), count=1400, hold=8.0,
                        sample=lambda: tree_usage(pid))),
                    "strangers": asyncio.run(outsider.strangers_aggregate(maddr, me, "atoll", identities=8,
                                                                          per_identity=8, wait=60.0)),
                }
                observed["peak"] = max(observed["outsider"]["idle"]["samples"], key=lambda u: u[1])
                observed["usage"] = {n: tree_usage(swarm.daemons[n].proc.pid) for n in HONEST}
                wait_for(lambda: "junk_records" in read()["done"], 120, "the junk records")
                observed["config_seen_by_joiner"] = joiner_config(swarm, key, root)
                assert member.wait(sum(s for _, s in PHASES) + 240) == 0, (root / "hostile.log").read_text()[-3000:]
                # The attacks must have met a training swarm: the phases ended before the honest daemons did.
                ended = {n: d.proc.poll() for n, d in swarm.daemons.items()}
                assert all(code is None for code in ended.values()), f"honest daemons ended before the attack: {ended}"
            finally:
                if member.poll() is None:
                    os.killpg(member.pid, signal.SIGKILL)
            observed.update(read())
        else:
            time.sleep(20)  # about when the attacked swarm's usage is sampled
            observed["usage"] = {n: tree_usage(swarm.daemons[n].proc.pid) for n in HONEST}
        observed["attack_s"] = time.monotonic() - started
        codes = {n: d.proc.wait(600) for n, d in swarm.daemons.items()}
        assert all(code == 0 for code in codes.values()), codes
        observed["rounds"] = {n: swarm.daemons[n].rounds() for n in HONEST}
        observed["summary"] = {n: next(m for m in swarm.daemons[n].metrics() if m.get("event") == "summary")
                               for n in HONEST}
        observed["log"] = {n: swarm.daemons[n].log() for n in HONEST}
        return observed


def joiner_config(swarm: LocalSwarm, key: RunKey, root: Path) -> dict:
    """The run config a joiner (a fresh token) takes from what the DHT holds, the hijacked record included."""
    token_path = root / "joiner.token"
    key.issue_token("atoll").save(token_path)
    token = JoinToken.load(token_path)
    dht = DHT(initial_peers=swarm.bootstrap, start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              record_validators=make_validators("atoll", token))
    try:
        values = unwrap_subkeys(dht_io.get_blocking(dht, config_key("atoll"))).values()
        chosen = choose_config("atoll", token, list(values))
        return {"records": len(values), "chosen": None if chosen is None else chosen.dict(exclude={"signature"})}
    finally:
        dht.shutdown()


def held_out(observed: dict, last: int = 1) -> float:
    """The honest daemons' mean held-out loss over their ``last`` rounds."""
    losses = [r["held_out_loss"] for n in HONEST for r in observed["rounds"][n][-last:]]
    return sum(losses) / len(losses)


def contributors(observed: dict) -> dict[str, list[list[str]]]:
    return {n: [sorted(r["contributors"]) for r in observed["rounds"][n]] for n in HONEST}


def merges(observed: dict) -> int:
    return sum(sum(len(r["contributors"]) > 1 for r in observed["rounds"][n]) for n in HONEST)


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    folder = tmp_path_factory.mktemp("credentials")
    key, _ = RunKey.load_or_create(folder / "run.key")
    # a's identity, made before the two swarms start at once (each would create it at its start otherwise).
    (folder / "a.key").write_bytes(MemberKey.generate().identity_bytes())
    for name in HONEST[1:]:
        key.issue_token("atoll").save(folder / f"{name}.token")
    return folder


@pytest.fixture(scope="module")
def swarms(tmp_path_factory, credentials):
    """Both swarms at once: they share no DHT, and each spends most of its time waiting (its steps are slowed, the
    member's phases and the outsider's attacks are timed), so together they take about as long as the attacked one
    alone. The comparison stays exact: each run's rounds wait for all three of its daemons."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {attack: pool.submit(run, tmp_path_factory.mktemp("attacked" if attack else "baseline"), credentials,
                                    attack) for attack in (False, True)}
        return {attack: future.result() for attack, future in runs.items()}


@pytest.fixture(scope="module")
def baseline(swarms):
    return swarms[False]


@pytest.fixture(scope="module")
def attacked(swarms):
    return swarms[True]


@pytest.mark.timeout(1500)  # both swarms run here (the fixtures)
def test_the_honest_daemons_train_as_if_the_attackers_were_absent(baseline, attacked):
    print(f"held-out loss: baseline {held_out(baseline):.4f}, attacked {held_out(attacked):.4f}; multi-member "
          f"rounds: {merges(baseline)} vs {merges(attacked)}; attack took {attacked['attack_s']:.0f} s: "
          f"{ {k: v for k, v in attacked.items() if k in dict(PHASES) or k == 'junk_records'} }")
    if contributors(attacked) == contributors(baseline):
        # The same rounds with the same members: the same trajectory, so the same losses (deterministic run).
        assert abs(held_out(attacked) - held_out(baseline)) <= 1e-3 * held_out(baseline)
    else:
        # A lost round sets the attacked swarm on another trajectory, and this run's final held-out loss is no
        # figure to compare across trajectories: every run here climbs 10-30% over its last four rounds, and
        # swarms differing only in data order end 2.52-3.11. The mean over the last quarter of the rounds is
        # held to the issue's bound (5%) instead; a poisoned model's is 10-100x.
        quarter = len(baseline["rounds"]["a"]) // 4
        assert abs(held_out(attacked, quarter) - held_out(baseline, quarter)) <= 0.05 * held_out(baseline, quarter)
    # Every round merged with the others, but for at most one (a member's first hostile answer can cost a round).
    assert merges(attacked) >= merges(baseline) - len(HONEST)
    hashes = {attacked["rounds"][n][-1]["hash"] for n in HONEST}
    assert len(hashes) == 1, hashes  # identical replicas at the end
    # The attacks reached the swarm: claims and registrations were published, the member was asked as a reducer.
    assert attacked["fake_heavier"]["claims_published"] > 0 and attacked["forged_rounds"]["registrations"] > 0
    assert attacked["hostile_reducer"]["hostile_answers"] > 0


def test_no_honest_daemon_adopted_the_fake_replica_or_the_forged_config(attacked):
    for name in HONEST:
        log = attacked["log"][name]
        assert "Traceback" not in log
        assert attacked["member"][-8:] not in _download_lines(log)  # never a donor
        assert not {r["hash"] for r in attacked["rounds"][name]} & set(attacked["zero_digests"])
        assert all(attacked["member"] not in r["contributors"] for r in attacked["rounds"][name])
    seen = attacked["config_seen_by_joiner"]
    assert seen["records"] >= 2 and seen["chosen"]["access"] == "private", seen  # the hijack was there, unchosen
    assert seen["chosen"]["fields"]["model"] == "nano" and seen["chosen"]["fields"]["clip_factor"] == 4.0


def _download_lines(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "downloaded fragment" in line or "to replay" in line)


def test_the_offences_are_counted_by_kind(attacked):
    kinds: dict[str, int] = {}
    for name in HONEST:
        for kind, count in attacked["summary"][name]["rejected_by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    print("rejected by kind:", json.dumps(kinds, sort_keys=True))
    assert kinds.get("reducer_weight", 0) + kinds.get("reducer_contributors", 0) >= 1, kinds  # a hostile reducer
    # Junk values and absurd registration times are refused when stored (``dht_schema``) or read; the junk alone
    # is twelve values.
    assert kinds.get("dht_schema", 0) + kinds.get("round_record_time", 0) > 12, kinds
    assert any(k.startswith("group_record") for k in kinds), kinds  # the singleton groups it decided
    # The fifty fake identities (subkeys of its own that carry no certificate of theirs).
    assert kinds.get("dht_member", 0) + kinds.get("dht_subkey", 0) >= 50, kinds
    assert kinds.get("unauthorized", 0) + kinds.get("member_check_limit", 0) + kinds.get("stream_limit", 0) >= 64


def test_memory_and_fds_stay_bounded(baseline, attacked):
    rss, fds = attacked["peak"]  # a's, while 1,400 idle streams were open to it
    frame_peak = max(attacked["outsider"]["frame"]["samples"])
    print(f"a under 1,400 idle streams: rss {rss / 2**20:.0f} MiB, fds {fds}; under the 1 GiB frame: rss "
          f"{frame_peak / 2**20:.0f} MiB; baseline a: {baseline['usage']['a'][0] / 2**20:.0f} MiB, "
          f"{baseline['usage']['a'][1]} fds")
    # Bounded by the guard's limits, not by the 1,400 streams (unguarded, each holds an fd in p2pd and one in a):
    # the strangers' streams a holds, those being opened and refused at that moment, and the member's, which
    # attacks meanwhile, two fds each; 64 more for the swarm's own rounds and DHT traffic during the attack.
    held = MAX_STRANGER_STREAMS + outsider.OPENING_AT_ONCE + MAX_STREAMS_PER_PEER
    assert fds <= baseline["usage"]["a"][1] + 2 * held + 64, (fds, held)
    assert frame_peak <= baseline["usage"]["a"][0] + 200 * 2**20
    for name in HONEST:
        rss, fds = attacked["usage"][name]
        base_rss, base_fds = baseline["usage"][name]
        print(f"{name}: rss {rss / 2**20:.0f} MiB (baseline {base_rss / 2**20:.0f}), fds {fds} ({base_fds})")
        assert rss <= 1.25 * base_rss + 100 * 2**20 and fds <= base_fds + 64
