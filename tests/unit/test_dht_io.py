"""Every DHT read and write gives up after a bounded time: a value that does not deserialize leaves hivemind's
``get`` future pending forever, and nothing that awaits one may hang with it."""

import asyncio
import concurrent.futures
import time

import pytest

from atoll.protocols import dht_io


class SilentDHT:
    """A DHT whose reads never complete (what a malformed value does to hivemind's future); writes succeed."""

    def __init__(self):
        self.stored = {}

    def get(self, key, latest, return_future):
        return asyncio.get_running_loop().create_future()  # never resolved

    def store(self, key, value, expiration_time, subkey, return_future):
        self.stored.setdefault(key, {})[subkey] = value
        done = asyncio.get_running_loop().create_future()
        done.set_result(True)
        return done


class BlockingSilentDHT:
    def get(self, key, latest, return_future):
        return concurrent.futures.Future()

    store = lambda self, *a, **k: concurrent.futures.Future()  # noqa: E731


def test_a_read_that_never_completes_returns_nothing_after_the_timeout_and_is_counted():
    seen = []
    start = time.monotonic()
    assert asyncio.run(dht_io.get(SilentDHT(), "k", timeout=0.1, on_timeout=seen.append)) is None
    assert 0.1 <= time.monotonic() - start < 2.0
    assert seen == ["dht_read_timeout"]


def test_blocking_reads_and_writes_give_up_too():
    seen = []
    assert dht_io.get_blocking(BlockingSilentDHT(), "k", timeout=0.05, on_timeout=seen.append) is None
    assert dht_io.store_blocking(BlockingSilentDHT(), "k", 1, 0.0, timeout=0.05, on_timeout=seen.append) is False
    assert seen == ["dht_read_timeout", "dht_write_timeout"]


def test_a_completed_read_passes_its_value_through():
    class Answering:
        async def get(self, key, latest, return_future):
            return {"value": key}

    assert asyncio.run(dht_io.get(Answering(), "k", timeout=1.0)) == {"value": "k"}


def test_forming_a_group_over_a_dht_that_never_answers_ends(monkeypatch):
    """The reproduced attack: one malformed value under a round's key and every registrant waited forever. Now
    each read gives up; with nobody else seen, the registrant decides a group of its own and the round goes on."""
    from atoll.protocols.matchmaking import PeerView, Policy, Registrant, Round, form_group

    monkeypatch.setattr(dht_io, "READ_TIMEOUT", 0.05)
    rejected = []

    async def run():
        return await asyncio.wait_for(form_group(
            SilentDHT(), Round("run", 0, 3, "D"), Registrant("me", b"me", 1.0), Policy(2.0), PeerView(),
            on_reject=lambda kind, src: rejected.append(kind)), timeout=10)

    assert asyncio.run(run()) == ["me"]
    assert rejected and set(rejected) == {"dht_read_timeout"}


@pytest.mark.parametrize("name", ["get", "store"])
def test_the_protocols_reach_the_dht_only_through_this_module(name):
    """No direct ``dht.get``/``dht.store`` left in node/ or protocols/ (one would be an unbounded await)."""
    import pathlib
    import re

    root = pathlib.Path(dht_io.__file__).resolve().parent.parent
    offenders = [f"{p.relative_to(root)}:{i}" for d in ("node", "protocols") for p in sorted((root / d).rglob("*.py"))
                 if p.name != "dht_io.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(rf"(?<!`)\bdht\.{name}\(", line)]
    assert offenders == []


def test_calls_are_counted_by_kind_with_the_entries_read():
    from hivemind.utils import ValueWithExpiration

    from atoll.protocols.matchmaking import group_key
    from atoll.protocols.records import (ALL_SHARDS, config_key, head_key, open_rounds_key, progress_key, revoked_key,
                                         round_key)
    from atoll.protocols.summary import summary_key

    kinds = {progress_key("r_open", 3): "progress", progress_key("r", 12): "progress",
             progress_key("r", ALL_SHARDS): "progress", summary_key("r"): "summary",
             open_rounds_key("r", 0, 5, "ab12"): "open", head_key("r"): "head",
             config_key("r"): "config", revoked_key("r"): "revoked", round_key("r", 0, 5): "round",
             round_key("r", 1, 12, "ab_cd"): "round", group_key("r", 0, 5): "group",
             group_key("r", 2, 7, "ab12"): "group", "r_elsewhere": "other"}
    assert {key: dht_io.key_kind(key) for key in kinds} == kinds

    class AnsweringDHT:
        def get(self, key, latest, return_future):
            future = concurrent.futures.Future()
            future.set_result(ValueWithExpiration({"a": 1, "b": 2, "c": 3}, 0.0))
            return future

    dht_io.CALLS.clear()
    assert dht_io.get_blocking(AnsweringDHT(), progress_key("r", 0)).value == {"a": 1, "b": 2, "c": 3}
    assert dht_io.get_blocking(AnsweringDHT(), progress_key("r", 0)) is not None
    assert dht_io.get_blocking(BlockingSilentDHT(), head_key("r"), timeout=0.01) is None
    summary = dht_io.calls_summary()
    assert list(summary) == ["get head", "get progress"]
    assert (summary["get progress"]["calls"], summary["get progress"]["entries"]) == (2, 6)
    assert (summary["get head"]["calls"], summary["get head"]["gave_up"], summary["get head"]["entries"]) == (1, 1, 0)


def test_calls_count_the_value_bytes_they_carried_by_kind():
    """A read counts the bytes of the subkeys and values it returned, a write those of the value (and subkey) it
    stored, whether or not it completed; against msgpack's lengths taken one by one."""
    import msgpack
    from hivemind.utils import ValueWithExpiration

    from atoll.protocols.records import progress_key, round_key

    records = {b"peer-a": {"step": 12, "sig": b"x" * 64}, b"peer-b": {"step": 7, "sig": b"y" * 64}}

    class AnsweringDHT:
        @staticmethod
        def found():
            return ValueWithExpiration({k: ValueWithExpiration(v, 0.0) for k, v in records.items()}, 0.0)

        def get(self, key, latest, return_future):
            future = concurrent.futures.Future()
            future.set_result(self.found())
            return future

        def run_coroutine(self, fn, return_future):  # get_many: fn is functools.partial(_latest, keys)
            future = concurrent.futures.Future()
            future.set_result({key: self.found() for key in fn.args[0]})
            return future

        def store(self, key, value, expiration_time, subkey, return_future):
            future = concurrent.futures.Future()
            future.set_result(True)
            return future

    def packed(x):
        return len(msgpack.packb(x, use_bin_type=True))

    dht_io.CALLS.clear()
    dht_io.get_blocking(AnsweringDHT(), progress_key("r", 0))
    dht_io.get_many_blocking(AnsweringDHT(), [progress_key("r", 0), progress_key("r", 1)])
    dht_io.get_blocking(BlockingSilentDHT(), progress_key("r", 0), timeout=0.01)  # nothing came back
    registration = {"peer_id": "a", "time": 1.5, "weight": 3}
    dht_io.store_blocking(AnsweringDHT(), round_key("r", 0, 5), registration, 60.0, subkey=b"key-a")
    dht_io.store_blocking(BlockingSilentDHT(), round_key("r", 0, 5), registration, 60.0, subkey=b"key-a",
                          timeout=0.01)  # gave up, but it went out
    one_read = sum(packed(k) + packed(v) for k, v in records.items())
    summary = dht_io.calls_summary()
    assert summary["get progress"]["bytes"] == 3 * one_read
    assert summary["store round"]["bytes"] == 2 * (packed(registration) + packed(b"key-a"))
    assert summary["store round"]["gave_up"] == 1
    assert dht_io.value_bytes(None) == 0 and dht_io.value_bytes(ValueWithExpiration(b"abc", 0.0)) == packed(b"abc")

