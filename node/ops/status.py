"""``atoll status``: read a run's configuration and progress records from the DHT (as a DHT client)."""

from __future__ import annotations

import json
import logging
import math
import time
import unicodedata
from typing import Any

from hivemind.utils import get_dht_time

from atoll.protocols import dht_io
from atoll.protocols.auth import AuthError, JoinToken, RunKey
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import (ALL_SHARDS, MAX_CLOCK_SKEW, READ_BUDGET, ProgressRecord, config_key,
                                     parse_progress, parse_run_config, progress_key, progress_keys, unwrap_subkeys)
from atoll.protocols.summary import merge, parse_summary, summary_key, totals

from ..checks import ConfigError
from .reader import check_target, open_reader


# A run of at most this many peers (by its summaries) is listed whole unless told otherwise; its daemons read, and
# write, the one key that holds every record (``node/rounds/peers.py``).
LIST_PEERS_UP_TO = READ_BUDGET
# No honest figure comes near these (1e18 tokens is a million times a large pre-training run); a record or summary
# beyond one is a stranger's, not shown (the second review's 1.7e308 figures).
MAX_FIGURE = 1e18
MAX_LOSS = 1e6
MAX_SHOWN_CHARS = 64  # of a string from the network, in the table


def plausible(values: dict[str, Any]) -> bool:
    """Whether every figure of a record or summary (its fields as a dict) is within what an honest daemon writes:
    numbers at most ``MAX_FIGURE`` (losses ``MAX_LOSS``), finite, not negative."""
    def ok(key: str, v: Any) -> bool:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return True
        if isinstance(v, (list, tuple)):
            return all(ok(key, x) for x in v)
        if isinstance(v, dict):
            return all(ok(key, x) for x in v.values())
        bound = MAX_LOSS if key in ("loss", "held_out_loss") else MAX_FIGURE
        return isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= bound

    return all(ok(k, v) for k, v in values.items() if k != "time")


def plain(text: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """A string from the network as plain text for a terminal: control and format characters (terminal escapes,
    bidirectional overrides) dropped, at most ``limit`` characters. Shown through ``rich.text.Text``, never as
    markup (a device of ``[/]`` made ``atoll status`` exit 1)."""
    out = "".join(ch for ch in str(text) if not unicodedata.category(ch).startswith("C"))
    return out if len(out) <= limit else out[: limit - 1] + "…"


def reader_validators(run_id: str, join_token: str | None = None, run_key: str | None = None
                      ) -> tuple[list, bool]:
    """The DHT validators of a reader (``atoll status``, ``atoll dashboard``), and whether they verify records: with
    a join token or the run key, only records whose certificates the run key signed are read; without, any signed
    record is (an outsider's own DHT node can add made-up peers), and the reader says so."""
    if join_token and run_key:
        raise ConfigError("join_token: give --join-token or --run-key, not both")
    token = None
    try:
        if join_token:
            token = JoinToken.load(join_token)
        elif run_key:
            token = RunKey.load(run_key).issue_token(run_id)  # in memory only: a reader's own member key
    except (AuthError, OSError) as e:
        raise ConfigError(f"{'join_token' if join_token else 'run_key'}: {e}") from None
    if token is not None and token.run_id != run_id:
        raise ConfigError(f"join_token: the token is for run {token.run_id!r}, not {run_id!r}")
    return list(make_validators(run_id, token)), token is not None


def collect_status(dht: Any, run_id: str, list_peers: bool | None = None, verified: bool = False
                   ) -> dict[str, Any]:
    """The stable JSON document ``atoll status --json`` prints: run_id, time, config, peers, totals, summary.

    One DHT call reads the run's config, its summaries (``protocols/summary.py``) and the key under which a small
    swarm's daemons write their records as well (``records.ALL_SHARDS``). Every peer is listed if ``list_peers``,
    whenever no summary was found, or by default when they count at most ``LIST_PEERS_UP_TO`` peers: ``peers`` is
    then the records sorted by peer id (from that one key in a small run, unless it holds fewer than the summaries
    count; from all 16 shards as well, in one more call, otherwise) and
    ``totals`` is made from them. Otherwise ``peers`` is None and ``totals`` is the summaries' median. ``summary``
    says which: ``{"source": "records" | "summaries", "summarizers": [peer ids], "age_s": age of the oldest summary
    used, "implausible": records and summaries left out for figures no honest daemon writes (``plausible``)}``.
    ``verified``: whether the DHT client checks certificates (``reader_validators``), said in the document."""
    now = get_dht_time()
    implausible = 0
    small = progress_key(run_id, ALL_SHARDS)
    found = dht_io.get_many_blocking(dht, [config_key(run_id), summary_key(run_id), small])
    configs = [c for c in map(parse_run_config, unwrap_subkeys(found.get(config_key(run_id))).values())
               if c is not None]
    config = min(configs, key=lambda c: c.started_at).fields if configs else None
    parsed = [s for s in map(parse_summary, unwrap_subkeys(found.get(summary_key(run_id))).values())
              if s is not None and s.time <= now + MAX_CLOCK_SKEW]
    summaries = [s for s in parsed if plausible(s.dict())]
    implausible += len(parsed) - len(summaries)
    merged = merge(summaries) if summaries else None
    is_small = merged is not None and merged["peers"] <= LIST_PEERS_UP_TO
    if list_peers is None or merged is None:  # no summary to show: the records are all there is
        list_peers = merged is None or is_small
    peers = None
    if list_peers:
        records = _newest(found.get(small)) if is_small else {}
        if not is_small or totals(records.values())["peers"] < merged["peers"]:
            # A small run's one key missed records that the summarizers' tables hold (a store or a read of it that
            # timed out on a loaded DHT; or peers that just left): their own shards, on other DHT nodes, hold them too.
            records = _newest(found.get(small), *dht_io.get_many_blocking(dht, progress_keys(run_id)).values())
        shown = [rec for rec in records.values() if plausible(rec.dict())]
        implausible += len(records) - len(shown)
        records = shown
        peers = sorted((rec.dict() for rec in records), key=lambda r: r["peer_id"])
        run_totals = totals(records)
    else:
        run_totals = merged
    summary = {"source": "records" if list_peers else "summaries",
               "summarizers": sorted(s.peer_id for s in summaries),
               "age_s": max((now - s.time for s in summaries), default=None), "implausible": implausible}
    return {"run_id": run_id, "time": time.time(), "config": config, "peers": peers, "totals": run_totals,
            "summary": summary, "verified": verified}


def _newest(*entries: Any) -> dict[str, ProgressRecord]:
    """The valid progress records of DHT ``entries`` (each None or {subkey: value}), the newest of each peer's."""
    out: dict[str, ProgressRecord] = {}
    for entry in entries:
        for rec in map(parse_progress, unwrap_subkeys(entry).values()):
            if rec is not None and (rec.peer_id not in out or rec.time > out[rec.peer_id].time):
                out[rec.peer_id] = rec
    return out


def rates(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, float] | None:
    """The run's rates between two status documents: tokens/s, rounds of the newest replica per minute (its
    version's growth) and bytes/s sent, from the change of the totals over the time between them; None for the
    first document, or when no time passed."""
    if before is None or after["time"] <= before["time"]:
        return None
    seconds = after["time"] - before["time"]
    a, b = before["totals"], after["totals"]
    return {"tokens_per_s": (b["tokens"] - a["tokens"]) / seconds,
            "versions_per_min": 60 * (b["max_version"] - a["max_version"]) / seconds,
            "sent_bytes_per_s": (b["bytes_sent"] - a["bytes_sent"]) / seconds}


def status_view(doc: dict[str, Any], rate: dict[str, float] | None = None) -> Any:
    """What ``atoll status`` shows for ``doc``: the run's totals as a title, and a table of every peer when the
    document lists them; with ``rate`` (``--watch``), the totals' rates since the previous read too."""
    from rich.table import Table
    from rich.text import Text

    totals_ = doc["totals"]
    title = (f"run {doc['run_id']}: {totals_['peers']} peers, {totals_['ranks']} ranks, {totals_['tokens']:,} tokens, "
             f"{totals_['tokens_per_s']:,.0f} tokens/s, version {totals_['max_version']}")
    if not doc.get("verified", False):
        title += "\nunverified: any signed record is shown (--join-token or --run-key checks certificates)"
    if doc["summary"].get("implausible"):
        title += f"\n{doc['summary']['implausible']} record(s) with impossible figures left out"
    if rate is not None:
        title += (f"\nsince the last read: {rate['tokens_per_s']:,.0f} tokens/s, {rate['versions_per_min']:.1f} "
                  f"versions/min, {rate['sent_bytes_per_s'] / 1e6:.2f} MB/s sent")
    if doc["peers"] is None:  # a large run: its summaries only
        summary = doc["summary"]
        return Text(f"{title}\n(the median of {len(summary['summarizers'])} summaries, the oldest "
                    f"{summary['age_s']:.0f} s old; --peers lists every peer)")
    table = Table(title=Text(title))
    for col in ("peer", "status", "device", "ranks", "step", "versions", "tokens", "tok/s", "loss", "held-out",
                "rounds", "skipped", "goodput", "blocked s", "forks healed", "tokens lost", "carried", "in flight", "sent MB", "recv MB",
                "rejected"):
        table.add_column(col, justify="left" if col in ("peer", "status", "device", "versions") else "right",
                         no_wrap=col == "peer")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for p in doc["peers"]:
        status = p["status"] if p["reachable"] else f"{p['status']} (NAT)"  # a --client-mode daemon
        table.add_row(*(Text(plain(cell)) for cell in (
                      p["peer_id"][-8:], status, p["device"], str(p["ranks"]), str(p["step"]),
                      "/".join(map(str, p["fragment_versions"])), f"{p['tokens']:,}", f"{p['tokens_per_s']:,.0f}",
                      fmt(p["loss"]), fmt(p["held_out_loss"]), str(p["rounds"]), str(p["rounds_skipped"]),
                      f"{p['goodput']:.2f}", f"{p['blocked_s']:.1f}", str(p["forks_healed"]), f"{p['tokens_lost']:,}",
                      f"{p.get('tokens_carried', 0):,}", _in_flight(p),
                      f"{p['bytes_sent'] / 1e6:.1f}", f"{p['bytes_received'] / 1e6:.1f}", str(p["rejected"]))))
    return table


def _in_flight(p: dict) -> str:
    """Steps from a round's snapshot to its merge, median/p95 ("-" before a round merged)."""
    if p.get("in_flight_p50") is None:
        return "-"
    return f"{p['in_flight_p50']}/{p['in_flight_p95']}"


def _console() -> Any:
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def render_table(doc: dict[str, Any]) -> None:
    _console().print(status_view(doc))


def watch(dht: Any, run_id: str, list_peers: bool | None, as_json: bool, interval: float,
          doc: dict[str, Any]) -> None:
    verified = doc.get("verified", False)
    """``atoll status --watch``: read the run again every ``interval`` seconds through the one DHT client, and show
    it in place (a JSON document a line with ``--json``) until Ctrl-C."""
    from rich.live import Live

    if as_json:
        while True:
            print(json.dumps(doc, sort_keys=True), flush=True)
            time.sleep(interval)
            doc = collect_status(dht, run_id, list_peers, verified)
    with Live(status_view(doc), console=_console(), auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            previous, doc = doc, collect_status(dht, run_id, list_peers, verified)
            live.update(status_view(doc, rates(previous, doc)), refresh=True)


def run_status(initial_peers: list[str], run_id: str, as_json: bool, list_peers: bool | None = None,
               watch_every: float | None = None, join_token: str | None = None, run_key: str | None = None) -> int:
    """``atoll status``: one read of the run, printed; with ``watch_every`` (``--watch``), read again every so many
    seconds until Ctrl-C, which ends it cleanly (exit 0). With ``join_token`` or ``run_key``, only records whose
    certificates check are read (``reader_validators``)."""
    if watch_every is not None and not watch_every > 0:
        raise ConfigError(f"watch: the interval must be positive, got {watch_every}")
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    check_target(run_id, initial_peers)
    validators, verified = reader_validators(run_id, join_token, run_key)
    dht = open_reader(run_id, initial_peers, validators)
    try:
        doc = collect_status(dht, run_id, list_peers, verified)
        if doc["config"] is None and not doc["peers"] and not doc["summary"]["summarizers"]:
            raise ConfigError(f"run_id: no run {run_id!r} found through {initial_peers[0]}")
        if watch_every is not None:
            try:
                watch(dht, run_id, list_peers, as_json, watch_every, doc)
            except KeyboardInterrupt:
                return 0
    finally:
        dht.shutdown()
    if as_json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        render_table(doc)
    return 0
