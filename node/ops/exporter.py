"""Prometheus metrics of one daemon (``--metrics-port``): what it counts anyway, read when scraped.

Nothing here counts: every value is read, at each scrape, from what the daemon keeps for its progress record and
its summary (``Counters``, the syncer's ``TrafficStats``), its replica's versions and its peer table. So a scrape
costs the daemon nothing between scrapes, and the endpoint can never disagree with ``atoll status`` or
``metrics.jsonl``. The names follow Prometheus's conventions: an ``atoll_`` prefix, units in the name, ``_total``
on counters; the daemon itself is the scrape target (its ``instance``), and ``atoll_info`` carries its peer id.
The reference is docs/operations.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from atoll.protocols import dht_io
from atoll.protocols.records import Status

from ..metrics import SKIPPED, Counters

if TYPE_CHECKING:
    from atoll.protocols.stats import TrafficStats

    from ..config import NodeConfig
    from ..rounds.replica import Replica
    from ..rounds.syncer import Syncer

logger = logging.getLogger("atoll")
# Every result a round of a fragment can end with, exported from the start at 0 so that rates work from the first
# scrape (Prometheus's advice for labelled counters).
ROUND_RESULTS = ("merged", "behind", "failed", "deferred", SKIPPED)


class DaemonCollector(Collector):
    """The metrics of one daemon, read at each ``collect()`` (prometheus_client calls it on each scrape, on the
    HTTP server's thread: every read here is of a value one writer updates, or a copy of a dict)."""

    def __init__(self, info: dict[str, str], counters: Counters, traffic: Callable[[], TrafficStats],
                 versions: Callable[[], list[int]], peers: Callable[[], int]) -> None:
        self.info, self.counters, self.traffic, self.versions, self.peers = info, counters, traffic, versions, peers

    def collect(self) -> Iterator[Metric]:
        c, traffic, versions = self.counters, self.traffic(), self.versions()
        info = GaugeMetricFamily("atoll_info", "this daemon: its peer id, run, device and algorithm (always 1)",
                                 labels=sorted(self.info))
        info.add_metric([self.info[k] for k in sorted(self.info)], 1)
        yield info
        status = GaugeMetricFamily("atoll_status", "1 for the daemon's status, 0 for the others", labels=["status"])
        for s in Status:
            status.add_metric([s.value], 1 if c.status is s else 0)
        yield status
        yield _counter("atoll_inner_steps", "inner steps trained", c.step)
        yield _counter("atoll_tokens", "tokens trained on", c.tokens)
        yield _gauge("atoll_tokens_per_second", "tokens trained per second, recently", c.tokens_per_s)
        yield _gauge("atoll_loss", "training loss of the last inner step", c.loss)
        yield _gauge("atoll_held_out_loss", "held-out loss of the last evaluation", c.held_out_loss)
        yield _gauge("atoll_held_out_step", "inner step of the last held-out evaluation", c.held_out_step)
        yield _counter("atoll_train_seconds", "seconds spent in inner steps", c.train_seconds)
        yield _counter("atoll_blocked_seconds", "seconds the training loop waited on the network", c.blocked_seconds)
        yield _counter("atoll_tokens_lost", "tokens whose work no merge kept (overwritten, dropped past the carry "
                       "bound, lost with a fork)", c.tokens_lost)
        p50, p95 = c.in_flight()
        yield _gauge("atoll_round_in_flight_steps_p50", "inner steps from a round's snapshot to its merge, median of "
                     "the recent merged rounds", p50)
        yield _gauge("atoll_round_in_flight_steps_p95", "inner steps from a round's snapshot to its merge, 95th "
                     "percentile of the recent merged rounds", p95)
        yield _counter("atoll_tokens_carried", "tokens of work a merge or an adoption moved onto a newer replica "
                       "instead of dropping it (each move counts)", c.tokens_carried)
        yield _counter("atoll_forks_healed", "forks of the replica this daemon healed by adopting a heavier one",
                       c.forks_healed)
        yield _counter("atoll_paused_seconds", "seconds paused, the machine lent back (atoll pause, --pause-when)",
                       c.paused_seconds)
        yield _counter("atoll_pauses", "times this daemon paused", c.pauses)
        yield _counter("atoll_rejoins", "times the DHT was bootstrapped again after a while with no live peer",
                       c.rejoins)
        rounds = CounterMetricFamily("atoll_rounds", "outer rounds by fragment and result: merged, behind (a heavier "
                                     "replica existed), failed, skipped (the previous one had not landed)",
                                     labels=["fragment", "result"])
        by_result = dict(c.rounds_by_result)
        for p in range(len(versions)):
            for result in ROUND_RESULTS:
                rounds.add_metric([str(p), result], by_result.get((p, result), 0))
        yield rounds
        durations = HistogramMetricFamily("atoll_round_duration_seconds", "seconds a merged round took, from its "
                                          "start to its result", labels=["fragment"])
        for p, hist in sorted(dict(c.round_seconds).items()):
            buckets = [(_le(bound), n) for bound, n in zip(hist.bounds, list(hist.counts))] + [("+Inf", hist.count)]
            durations.add_metric([str(p)], buckets, hist.sum)
        yield durations
        version = GaugeMetricFamily("atoll_replica_version", "version of each fragment of this daemon's replica",
                                    labels=["fragment"])
        for p, v in enumerate(versions):
            version.add_metric([str(p)], v)
        yield version
        yield _gauge("atoll_peers", "training peers in this daemon's table (itself not counted)", self.peers())
        yield _counter("atoll_sent_bytes", "bytes this daemon sent in rounds and state transfers", traffic.bytes_sent)
        yield _counter("atoll_received_bytes", "bytes this daemon received in rounds and state transfers",
                       traffic.bytes_received)
        rejected = CounterMetricFamily("atoll_rejected", "network input and DHT records rejected, by kind",
                                       labels=["kind"])
        for kind, n in sorted(dict(traffic.rejected_by_kind).items()):
            rejected.add_metric([kind], n)
        yield rejected
        yield _counter("atoll_clipped", "contributions robust merging scaled down", traffic.clipped)
        calls = CounterMetricFamily("atoll_dht_calls", "DHT reads (get) and writes (store) this daemon made, by record "
                                    "kind", labels=["op", "kind"])
        sizes = CounterMetricFamily("atoll_dht_value_bytes", "bytes of the records this daemon's DHT writes stored "
                                    "and its reads returned, each once (replicas and framing not counted), by kind",
                                    labels=["op", "kind"])
        for name, stats in dht_io.calls_summary().items():
            op, kind = name.split(" ", 1)
            calls.add_metric([op, kind], stats["calls"])
            sizes.add_metric([op, kind], stats["bytes"])
        yield calls
        yield sizes
        age = None if c.checkpoint_at is None else max(0.0, time.time() - c.checkpoint_at)
        yield _gauge("atoll_checkpoint_age_seconds", "seconds since the last checkpoint was written", age)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge; NaN where there is no value yet (no loss before the first step, no checkpoint before the first)."""
    return GaugeMetricFamily(name, doc, value=math.nan if value is None else value)


def _le(bound: float) -> str:
    return repr(float(bound))


class MetricsEndpoint:
    """This daemon's Prometheus endpoint at ``http://cfg.metrics_host:cfg.metrics_port/metrics`` (port 0 takes a
    free one), served on a thread of its own. It binds when made, before the daemon joins the DHT, so that a port
    that cannot be bound is a ``ConfigError`` at once; it serves the daemon's metrics once ``serve`` has them (an
    empty page before). ``stop`` ends it."""

    def __init__(self, cfg: NodeConfig) -> None:
        from ..config import ConfigError

        self.host = cfg.metrics_host
        self.registry = CollectorRegistry(auto_describe=False)
        try:
            self.server, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"metrics_port: cannot listen on {cfg.metrics_host}:{cfg.metrics_port}: "
                              f"{e.strerror or e}") from None
        self.port = self.server.server_port

    def serve(self, cfg: NodeConfig, peer_id: str, counters: Counters, syncer: Syncer, replica: Replica) -> None:
        """Serve the daemon's metrics (read at each scrape from what it keeps; ``cfg`` the agreed config), and log
        the address."""
        self.registry.register(DaemonCollector(
            {"peer_id": peer_id, "run_id": cfg.run_id, "device": counters.device, "algorithm": cfg.run.algorithm},
            counters, lambda: syncer.stats, lambda: [v for v, _, _ in replica.identities()],
            lambda: len(syncer.table.training())))
        logger.info("Prometheus metrics at http://%s:%d/metrics", self.host, self.port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
