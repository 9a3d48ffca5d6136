"""An outsider without a join token cannot exhaust a private run's daemon (issue 19): a frame declaring 1 GiB is
refused before it is buffered, 1,400 idle streams from one identity cost a bounded number of fds, and throwaway
identities asking to aggregate hold no waiting slot. The victim keeps publishing heartbeats throughout.
Attacks live in ``scripts/hostile/outsider.py``; the figures they observe are printed (``pytest -s``)."""

import asyncio
import json
import os
import resource

import pytest
from scripts.hostile import outsider
from hivemind.utils import get_dht_time
from scripts.swarm import LocalSwarm, StatusReader
from support.swarms import peer_id, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.waits]

COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1"]
FD_LIMIT = 1024  # the victim runs under the limit the review exhausted
MAX_RSS_GROWTH_MB = 100
MAX_FDS = 400
REFUSALS = ("unauthorized", "member_check_limit", "stream_limit")  # what a stranger's stream meets in a private run


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("outsider"), COMMON)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(FD_LIMIT, hard), hard))  # inherited by the daemon
    try:
        s.start("a", join=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    reader = StatusReader(s.bootstrap)
    try:
        yield s, s.daemons["a"], reader
    finally:
        reader.close()
        s.stop_all(timeout=30)


def record(reader: StatusReader, peer: str) -> dict | None:
    return next((p for p in reader.read()["peers"] if p["peer_id"] == peer), None)


def heartbeat_after(reader: StatusReader, peer: str, t: float) -> dict:
    """The victim's progress record, once one newer than ``t`` (its own clock, DHT time) is visible."""
    return wait_for(lambda: (r := record(reader, peer)) is not None and r["time"] > t and r, 60,
                    "a fresh heartbeat of the victim")


def test_an_outsider_cannot_exhaust_a_private_daemon(victim):
    swarm, a, reader = victim
    pid, me, maddr = a.proc.pid, peer_id(a), a.maddrs[0]
    wait_for(lambda: a.rounds(), 180, "the victim to merge a round")  # settled: training, rounds, state to serve
    before = heartbeat_after(reader, me, 0.0)
    figures: dict = {"fd_limit": FD_LIMIT}

    # (a) One frame declaring 1 GiB (and 1 GiB sent): refused at its header, the stream closed.
    rss0 = rss_mb(pid)
    frame = asyncio.run(outsider.oversized_frame(maddr, me, outsider.handler("atoll", outsider.AGGREGATE),
                                                 sample=lambda: rss_mb(pid)))
    figures["frame"] = {k: v for k, v in frame.items() if k != "samples"} | {
        "rss_before_mb": round(rss0, 1), "rss_peak_mb": round(max(frame["samples"]), 1),
        "rss_after_mb": round(frame["samples"][-1], 1)}
    assert frame["closed_by_victim"] and frame["sent"] < frame["declared"]
    assert max(frame["samples"]) - rss0 < MAX_RSS_GROWTH_MB
    assert a.alive()

    # (b) 1,400 idle streams from one identity, to both handlers: refused or closed, fds stay bounded.
    fds0 = open_fds(pid)
    idle = {}
    for method in (outsider.AGGREGATE, outsider.DOWNLOAD):
        idle[method] = asyncio.run(outsider.idle_streams(maddr, me, outsider.handler("atoll", method), count=1400,
                                                         hold=12.0, sample=lambda: open_fds(pid)))
    figures["idle"] = {m: {k: v for k, v in r.items() if k != "samples"} | {"fds_peak": max(r["samples"])}
                       for m, r in idle.items()} | {"fds_before": fds0}
    for r in idle.values():
        assert r["opened"] + r["open_failed"] == 1400 and r["still_open"] == 0
        assert max(r["samples"]) < MAX_FDS
    assert a.alive()

    # (c) Eight throwaway identities, eight requests each, each asking to wait 60 s for a group: none waits.
    strangers = asyncio.run(outsider.strangers_aggregate(maddr, me, "atoll", identities=8, per_identity=8, wait=60.0))
    figures["strangers"] = {k: v for k, v in strangers.items() if k != "samples"}
    assert strangers["refused"] == strangers["calls"] == 64, strangers["outcomes"]
    assert strangers["longest_s"] < 20.0  # the membership look (3 s) and the p2p set-up, not the 60 s asked

    # Still a live member of its swarm, publishing heartbeats, with every refusal counted in its record.
    after = heartbeat_after(reader, me, get_dht_time() + 1)  # published after every attack ended
    kinds = after["rejected_by_kind"]
    figures["rejected_by_kind"] = kinds
    figures["fds_end"], figures["rss_end_mb"] = open_fds(pid), round(rss_mb(pid), 1)
    print("outsider figures:", json.dumps(figures, indent=1))
    assert kinds.get("frame_too_large", 0) == 0  # a stranger is refused before any of its frames is read
    assert sum(kinds.get(k, 0) for k in REFUSALS) > 0
    assert a.alive() and "refused a stream of" in a.log()
    assert a.log().count("refused a stream of") < 100  # rate-limited: one line per kind every 10 s

    # Every stream that reached the victim was refused and counted (it is alone: no member opened any). Not every
    # stream opened reached it: under load its p2pd resets those it cannot hand over (alone on this machine
    # none, under a full ``make test`` in CI 23%); each was still closed, and the victim's fds stayed bounded.
    assert swarm.stop_all(timeout=30) == {"a": 0}
    summary = next(m for m in a.metrics() if m.get("event") == "summary")
    opened = sum(r["opened"] for r in idle.values()) + strangers["calls"] + 1
    print(f"streams opened {opened}, reached the victim {summary['streams_in']}")
    assert 0 < summary["streams_in"] <= opened
    assert sum(summary["rejected_by_kind"].get(k, 0) for k in REFUSALS) == summary["streams_in"]


@pytest.fixture(scope="module")
def open_victim(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("outsider-open"), COMMON, private=False)
    try:
        s.start("a", ["--open"], join=False)
        reader = StatusReader(s.bootstrap)
        try:
            yield s, s.daemons["a"], reader
        finally:
            reader.close()
    finally:
        s.stop_all(timeout=30)


def test_in_an_open_run_frames_are_bounded_and_idle_streams_closed(open_victim):
    """Anyone may join an open run, so no membership check stops a stranger's streams: the frame bound, the stream
    limits and the first-message deadline do."""
    swarm, a, reader = open_victim
    pid, me, maddr = a.proc.pid, peer_id(a), a.maddrs[0]
    heartbeat_after(reader, me, 0.0)
    rss0 = rss_mb(pid)
    frame = asyncio.run(outsider.oversized_frame(maddr, me, outsider.handler("atoll", outsider.AGGREGATE),
                                                 sample=lambda: rss_mb(pid)))
    idle = asyncio.run(outsider.idle_streams(maddr, me, outsider.handler("atoll", outsider.DOWNLOAD), count=1400,
                                             hold=12.0, sample=lambda: open_fds(pid)))
    after = heartbeat_after(reader, me, get_dht_time() + 1)
    kinds = after["rejected_by_kind"]
    print("open-run figures:", json.dumps({
        "frame": {k: v for k, v in frame.items() if k != "samples"} | {
            "rss_before_mb": round(rss0, 1), "rss_peak_mb": round(max(frame["samples"]), 1)},
        "idle": {k: v for k, v in idle.items() if k != "samples"} | {"fds_peak": max(idle["samples"])},
        "rejected_by_kind": kinds}, indent=1))
    assert frame["closed_by_victim"] and frame["sent"] < frame["declared"]
    assert max(frame["samples"]) - rss0 < MAX_RSS_GROWTH_MB
    assert kinds.get("frame_too_large") == 1
    assert idle["still_open"] == 0 and max(idle["samples"]) < MAX_FDS
    assert kinds.get("first_message_timeout", 0) >= 1 and kinds.get("stream_limit", 0) >= 1
    assert a.alive()
