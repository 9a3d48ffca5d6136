"""``atoll status``: read a run's configuration and progress records from the DHT (as a DHT client)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from atoll.protocols import dht_io
from atoll.protocols.records import (
    config_key,
    make_validators,
    parse_progress,
    parse_run_config,
    progress_keys,
    unwrap_subkeys,
)

from .config import ConfigError, NodeConfig


def collect_status(dht: Any, run_id: str) -> dict[str, Any]:
    """The stable JSON document ``atoll status --json`` prints: run_id, config, peers (sorted), totals."""
    peers = []
    for entry in dht_io.get_many_blocking(dht, progress_keys(run_id)).values():
        for value in unwrap_subkeys(entry).values():
            rec = parse_progress(value)
            if rec is not None:
                peers.append(rec.dict())
    peers.sort(key=lambda r: r["peer_id"])
    configs = [c for c in map(parse_run_config, unwrap_subkeys(dht_io.get_blocking(dht, config_key(run_id))).values())
               if c is not None]
    config = min(configs, key=lambda c: c.started_at).fields if configs else None
    active = [p for p in peers if p["status"] != "leaving"]
    totals = {
        "peers": len(active),
        "ranks": sum(p["ranks"] for p in active),
        "tokens": sum(p["tokens"] for p in active),
        "tokens_per_s": sum(p["tokens_per_s"] for p in active),
        "max_version": max((p["version"] for p in active), default=0),
        "bytes_sent": sum(p["bytes_sent"] for p in active),
        "bytes_received": sum(p["bytes_received"] for p in active),
    }
    return {"run_id": run_id, "time": time.time(), "config": config, "peers": peers, "totals": totals}


def render_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {doc['run_id']}: {doc['totals']['peers']} peers, "
                        f"{doc['totals']['tokens']:,} tokens, {doc['totals']['tokens_per_s']:,.0f} tokens/s")
    for col in ("peer", "status", "device", "ranks", "step", "versions", "tokens", "tok/s", "loss", "held-out",
                "rounds", "skipped", "goodput", "blocked s", "forks healed", "tokens lost", "sent MB", "recv MB",
                "rejected"):
        table.add_column(col, justify="left" if col in ("peer", "status", "device", "versions") else "right")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for p in doc["peers"]:
        status = p["status"] if p["reachable"] else f"{p['status']} (NAT)"  # a --client-mode daemon
        table.add_row(p["peer_id"][-8:], status, p["device"], str(p["ranks"]), str(p["step"]),
                      "/".join(map(str, p["fragment_versions"])), f"{p['tokens']:,}", f"{p['tokens_per_s']:,.0f}",
                      fmt(p["loss"]), fmt(p["held_out_loss"]), str(p["rounds"]), str(p["rounds_skipped"]),
                      f"{p['goodput']:.2f}", f"{p['blocked_s']:.1f}", str(p["forks_healed"]), f"{p['tokens_lost']:,}",
                      f"{p['bytes_sent'] / 1e6:.1f}", f"{p['bytes_received'] / 1e6:.1f}", str(p["rejected"]))
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table)


def run_status(initial_peers: list[str], run_id: str, as_json: bool) -> int:
    from .join import start_dht

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    cfg = NodeConfig(run_id=run_id, initial_peers=tuple(initial_peers), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    cfg.validate()
    dht = start_dht(cfg, list(make_validators(run_id)), client_mode=True)
    try:
        doc = collect_status(dht, run_id)
    finally:
        dht.shutdown()
    if doc["config"] is None and not doc["peers"]:
        raise ConfigError(f"run_id: no run {run_id!r} found through {initial_peers[0]}")
    if as_json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        render_table(doc)
    return 0
