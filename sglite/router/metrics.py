"""The router's Prometheus metrics (`GET /metrics`), one series per worker.

Every number lives on the `Worker` objects (the router needs them for routing anyway) and is read
at scrape time, so workers added or removed at runtime appear and disappear with no bookkeeping.
Each router has its own registry, so several routers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sglite.router.workers import WorkerRegistry

PREFIX = "sglite_router:"


class _WorkerCollector(Collector):
    """Per-worker counters and gauges read from the registry when Prometheus scrapes."""

    def __init__(self, workers: WorkerRegistry, tree_size: Callable[[str], int]) -> None:
        self._workers = workers
        self._tree_size = tree_size

    def collect(self):  # noqa: D102 - prometheus-client interface
        routed = CounterMetricFamily(
            PREFIX + "requests", "Requests sent to the worker (retries included)", labels=["worker"]
        )
        retries = CounterMetricFamily(
            PREFIX + "retries",
            "Requests moved to another worker after this one failed them",
            labels=["worker"],
        )
        decisions = CounterMetricFamily(
            PREFIX + "decisions",
            "Routing decisions by kind: prefix_match, low_match (least load), imbalance "
            "(cache_aware); round_robin; least_load",
            labels=["worker", "kind"],
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "in_flight_requests", "Requests in flight on the worker", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            PREFIX + "worker_healthy", "1 if the worker gets traffic, else 0", labels=["worker"]
        )
        tree = GaugeMetricFamily(
            PREFIX + "tree_size",
            "Characters (or token ids) of prefixes the router attributes to the worker",
            labels=["worker"],
        )
        for w in self._workers.all_workers():
            routed.add_metric([w.url], w.routed)
            retries.add_metric([w.url], w.retries)
            for kind, n in sorted(w.decisions.items()):
                decisions.add_metric([w.url, kind], n)
            in_flight.add_metric([w.url], w.in_flight)
            healthy.add_metric([w.url], 1 if w.healthy else 0)
            tree.add_metric([w.url], self._tree_size(w.url))
        yield from (routed, retries, decisions, in_flight, healthy, tree)


class RouterMetrics:
    """The router's Prometheus registry."""

    def __init__(self, workers: WorkerRegistry, tree_size: Callable[[str], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(workers, tree_size))

    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        return generate_latest(self.registry)
