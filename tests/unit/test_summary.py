"""A run's summaries (``protocols/summary.py``): the totals against a naive sum, who summarizes, the median that
one liar cannot move, and ``atoll status`` reading the summaries instead of every record of a large run (no
sockets: the DHT read is replaced by a stub)."""

import math
import random
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from atoll.node.ops import status as status_module
from atoll.node.ops.status import collect_status
from atoll.protocols.records import ALL_SHARDS, config_key, parse_progress, progress_key, progress_keys, progress_shard
from atoll.protocols.summary import (
    SUMMARIZERS,
    TOTALS,
    SummaryRecord,
    is_summarizer,
    merge,
    parse_summary,
    summary_key,
    totals,
)
from support.records import busy_progress


def _records(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        version = rng.randint(0, 50)
        out.append(parse_progress(busy_progress(
            peer_id=f"p{i}", status=rng.choice(["joining", "training", "training", "leaving"]),
            ranks=rng.randint(1, 8), tokens=rng.randint(0, 10**9), tokens_per_s=rng.uniform(0, 1e5), version=version,
            fragment_versions=[version], bytes_sent=rng.randint(0, 10**9), bytes_received=rng.randint(0, 10**9))))
    return out


def test_totals_match_a_naive_sum_leaving_peers_left_out():
    records = _records(200)
    live = [r for r in records if r.status != "leaving"]
    assert 0 < len(live) < len(records)
    got = totals(records)
    assert got["peers"] == len(live)
    assert got["ranks"] == sum(r.ranks for r in live)
    assert got["tokens"] == sum(r.tokens for r in live)
    assert math.isclose(got["tokens_per_s"], math.fsum(r.tokens_per_s for r in live), rel_tol=1e-12)
    assert got["max_version"] == max(r.version for r in live)
    assert got["bytes_sent"] == sum(r.bytes_sent for r in live)
    assert got["bytes_received"] == sum(r.bytes_received for r in live)
    assert set(got) == set(TOTALS)
    assert totals([]) == {"peers": 0, "ranks": 0, "tokens": 0, "tokens_per_s": 0.0, "max_version": 0,
                          "bytes_sent": 0, "bytes_received": 0}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 50, 1000])
def test_daemons_that_know_everyone_agree_on_the_summarizers(n):
    ids = [f"Qm{i:04d}" for i in range(n)]
    chosen = [p for p in ids if is_summarizer(p, ids)]
    assert len(chosen) == min(n, SUMMARIZERS)
    # the same as a naive sort by rank
    from atoll.protocols.summary import summary_rank

    assert sorted(chosen) == sorted(sorted(ids, key=summary_rank)[:SUMMARIZERS])


def test_a_daemon_that_knows_few_peers_may_summarize_too():
    ids = [f"Qm{i:04d}" for i in range(100)]
    lowest = [p for p in ids if is_summarizer(p, ids)]
    outsider = next(p for p in ids if p not in lowest)
    assert is_summarizer(outsider, [])  # a table that is still empty: it counts itself among the lowest
    assert not is_summarizer(outsider, lowest)


def _summary(peer: str, **changes) -> SummaryRecord:
    fields = {"peer_id": peer, "peers": 1000, "ranks": 1200, "tokens": 10**9, "tokens_per_s": 5e5,
              "max_version": 40, "bytes_sent": 10**10, "bytes_received": 10**10, "time": float(get_dht_time())}
    fields.update(changes)
    return SummaryRecord(**fields)


def test_the_median_of_three_summaries_is_not_moved_by_one_liar():
    honest = [_summary("a", peers=1000, tokens=100), _summary("b", peers=1002, tokens=105)]
    for lie in (0, 10**15):
        merged = merge([*honest, _summary("liar", peers=lie % (1 << 24), tokens=lie)])
        assert 1000 <= merged["peers"] <= 1002 and 100 <= merged["tokens"] <= 105
    # An even count takes the lower median: a figure one of them gave, an integer stays an integer.
    assert merge(honest)["peers"] == 1000 and isinstance(merge(honest)["peers"], int)
    with pytest.raises(ValueError):
        merge([])


@pytest.mark.parametrize("changes", [
    {"peers": -1}, {"peers": 1.0}, {"tokens_per_s": math.nan}, {"tokens_per_s": -1.0}, {"time": math.inf},
    {"extra": 1}, {"peer_id": ""}, {"peer_id": "Q" * 129}, {"max_version": "3"}, {"peers": 1 << 30}])
def test_malformed_summaries_are_refused(changes):
    value = _summary("a").dict()
    value.update(changes)
    assert parse_summary(value) is None
    assert parse_summary(_summary("a").dict()) is not None
    assert parse_summary("garbage") is None


class StubDHT:
    """``dht_io.get_many_blocking`` over a dict of key -> {subkey: value}; notes each call's keys."""

    def __init__(self, held: dict) -> None:
        self.held, self.calls = held, []

    def get_many_blocking(self, dht, keys, timeout=None, on_timeout=None):
        self.calls.append(list(keys))
        return {key: SimpleNamespace(value={sk: SimpleNamespace(value=v) for sk, v in self.held[key].items()})
                if key in self.held else None for key in keys}


def _run(monkeypatch, peers: int, summaries: list[SummaryRecord]) -> StubDHT:
    records = _records(peers, seed=1)
    held: dict = {config_key("run"): {b"c": {"fields": {"model": "nano"}, "started_by": "p0", "started_at": 1.0}}}
    for r in records:
        held.setdefault(progress_key("run", progress_shard(r.peer_id)), {})[r.peer_id.encode()] = r.dict()
        held.setdefault(progress_key("run", ALL_SHARDS), {})[r.peer_id.encode()] = r.dict()
    held[summary_key("run")] = {s.peer_id.encode(): s.dict() for s in summaries}
    stub = StubDHT(held)
    monkeypatch.setattr(status_module.dht_io, "get_many_blocking", stub.get_many_blocking)
    stub.records = records
    return stub


def test_status_of_a_large_run_reads_its_summaries_only(monkeypatch):
    stub = _run(monkeypatch, 5, [_summary("a", peers=1000), _summary("b", peers=1001), _summary("c", peers=999)])
    doc = collect_status(None, "run")
    assert stub.calls == [[config_key("run"), summary_key("run"), progress_key("run", ALL_SHARDS)]]  # one call
    assert doc["peers"] is None and doc["totals"]["peers"] == 1000 and doc["config"] == {"model": "nano"}
    assert doc["summary"]["source"] == "summaries" and doc["summary"]["summarizers"] == ["a", "b", "c"]
    assert 0 <= doc["summary"]["age_s"] < 60


def test_status_lists_every_peer_of_a_small_run_or_when_asked(monkeypatch):
    small = [_summary("a", peers=totals(_records(30, seed=1))["peers"])]
    # A small run's records are all under one key, read in the first call; otherwise every shard is read next.
    for summaries, list_peers, calls in ((small, None, 1), (small, True, 1), ([], None, 2), ([], False, 2),
                                         ([_summary("a")], True, 2)):
        stub = _run(monkeypatch, 30, summaries)
        doc = collect_status(None, "run", list_peers)
        assert len(stub.calls) == calls and (calls == 1 or stub.calls[1] == progress_keys("run"))
        assert [p["peer_id"] for p in doc["peers"]] == sorted(r.peer_id for r in stub.records)
        assert doc["totals"] == pytest.approx(totals(stub.records), rel=1e-12)  # summed in shard order
        assert doc["summary"]["source"] == "records"


def test_status_reads_the_shards_when_the_one_key_holds_fewer_records_than_the_summaries_count(monkeypatch):
    # A loaded DHT: the one key's nodes missed two records (a store or a read that timed out); each record's own
    # shard, on other nodes, holds it. A stale copy under the one key does not hide a newer one in the shard.
    counted = totals(_records(30, seed=1))["peers"]  # the peers not leaving, as the summarizers count them
    stub = _run(monkeypatch, 30, [_summary("a", peers=counted), _summary("b", peers=counted)])
    everyone = stub.held[progress_key("run", ALL_SHARDS)]
    for missed in [r for r in stub.records if r.status != "leaving"][:2]:
        del everyone[missed.peer_id.encode()]
    stale = stub.records[2]
    newer = dict(stale.dict(), time=stale.time + 1, step=stale.step + 100)
    stub.held[progress_key("run", progress_shard(stale.peer_id))][stale.peer_id.encode()] = newer
    doc = collect_status(None, "run")
    assert len(stub.calls) == 2 and stub.calls[1] == progress_keys("run")
    assert [p["peer_id"] for p in doc["peers"]] == sorted(r.peer_id for r in stub.records)
    assert next(p for p in doc["peers"] if p["peer_id"] == stale.peer_id)["step"] == stale.step + 100
    assert doc["totals"]["peers"] == counted and doc["summary"]["source"] == "records"


def test_status_drops_summaries_from_the_future(monkeypatch):
    stub = _run(monkeypatch, 3, [_summary("a", time=get_dht_time() + 3600)])
    doc = collect_status(None, "run")
    assert doc["summary"]["summarizers"] == [] and len(doc["peers"]) == 3 and len(stub.calls) == 2


def test_the_table_of_a_large_run_is_its_totals_and_a_hint(monkeypatch, capsys):
    _run(monkeypatch, 5, [_summary("a", peers=1000, ranks=1200), _summary("b", peers=1001, ranks=1201)])
    status_module.render_table(collect_status(None, "run"))
    out = capsys.readouterr().out
    assert "1000 peers, 1200 ranks" in out and "median of 2 summaries" in out and "--peers" in out


def test_watch_rates_are_the_totals_change_over_the_time_between_reads():
    def doc(t, tokens, version, sent):
        return {"time": t, "totals": {"tokens": tokens, "max_version": version, "bytes_sent": sent}}

    assert status_module.rates(None, doc(10.0, 0, 0, 0)) is None  # the first read has no rate
    assert status_module.rates(doc(10.0, 0, 0, 0), doc(10.0, 5, 1, 1)) is None  # no time passed
    r = status_module.rates(doc(10.0, 1000, 4, 2_000_000), doc(14.0, 9000, 6, 6_000_000))
    assert r == {"tokens_per_s": 2000.0, "versions_per_min": 30.0, "sent_bytes_per_s": 1_000_000.0}


def test_the_watched_table_shows_the_rates_under_the_totals(monkeypatch, capsys):
    from rich.console import Console

    _run(monkeypatch, 3, [])
    doc = collect_status(None, "run")
    Console(width=250).print(status_module.status_view(doc, {"tokens_per_s": 1234.0, "versions_per_min": 2.5,
                                                             "sent_bytes_per_s": 3e6}))
    out = capsys.readouterr().out
    assert "since the last read: 1,234 tokens/s, 2.5 versions/min, 3.00 MB/s sent" in out
    assert all(r.peer_id[-8:] in out for r in _records(3, seed=1))


def test_strangers_strings_are_shown_as_plain_text_and_impossible_figures_left_out(monkeypatch, capsys):
    """The second review: a ``device`` of ``[/]`` made ``atoll status`` exit 1 (rich markup); terminal escapes and
    1.7e308 figures went into the table. Strings from the network are plain text without control characters, and
    a record or summary with figures no honest daemon writes is left out (and counted)."""
    from rich.console import Console

    stub = _run(monkeypatch, 3, [_summary("a", peers=3), _summary("huge", peers=3, tokens=10**300)])
    shared = stub.held[progress_key("run", ALL_SHARDS)]
    first, second = stub.records[0], stub.records[1]
    shared[first.peer_id.encode()] = dict(first.dict(), device="[/]\x1b[2J\x1b]0;owned\x07\u202egpu")
    shared[second.peer_id.encode()] = dict(second.dict(), tokens_per_s=1.7e308)
    doc = collect_status(None, "run")
    assert second.peer_id not in [p["peer_id"] for p in doc["peers"]]
    assert doc["summary"]["implausible"] == 2 and doc["summary"]["summarizers"] == ["a"]
    assert doc["verified"] is False
    Console(width=300).print(status_module.status_view(doc))
    out = capsys.readouterr().out
    assert "[/]" in out and "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "unverified" in out and "1 record(s)" not in out and "2 record(s) with impossible figures" in out
    assert status_module.plain("x" * 100).endswith("…") and len(status_module.plain("x" * 100)) == 64


def test_plausible_matches_the_bounds():
    from atoll.node.ops.status import MAX_FIGURE, MAX_LOSS, plausible

    rec = _records(1, seed=3)[0].dict()
    assert plausible(rec)
    for key, value in (("tokens", int(MAX_FIGURE) + 1), ("held_out_loss", MAX_LOSS * 2),
                       ("fragment_weights", [1.0, MAX_FIGURE * 10]), ("rejected_by_kind", {"x": 10**19})):
        assert not plausible(dict(rec, **{key: value})), key
    assert plausible(dict(rec, held_out_loss=None, device="[/]"))


def test_a_reader_given_a_token_or_the_run_key_verifies_certificates(tmp_path):
    from atoll.node.config import ConfigError
    from atoll.node.ops.status import reader_validators
    from atoll.protocols.auth import RunKey
    from atoll.protocols.auth import MembershipValidator

    key, _ = RunKey.load_or_create(tmp_path / "run.key")
    key.issue_token("run").save(tmp_path / "member.token")
    validators, verified = reader_validators("run")
    assert not verified
    for kwargs in ({"join_token": str(tmp_path / "member.token")}, {"run_key": str(tmp_path / "run.key")}):
        validators, verified = reader_validators("run", **kwargs)
        membership = next(v for v in validators if isinstance(v, MembershipValidator))
        assert verified and membership.run_public_key == key.public_bytes
    with pytest.raises(ConfigError, match="not both"):
        reader_validators("run", str(tmp_path / "member.token"), str(tmp_path / "run.key"))
    with pytest.raises(ConfigError, match="^join_token: "):
        reader_validators("run", join_token=str(tmp_path / "missing.token"))
    with pytest.raises(ConfigError, match="for run 'run', not 'other'"):
        reader_validators("other", join_token=str(tmp_path / "member.token"))
