"""The router's Prometheus metrics (`GET /metrics`), one series per worker (of every group).

Every number lives on the `Worker` objects (the router needs them for routing anyway) and is read
at scrape time, so workers added or removed at runtime appear and disappear with no bookkeeping.
Each router has its own registry, so several routers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sglite.router.workers import WorkerGroup

PREFIX = "sglite_router:"


class _WorkerCollector(Collector):
    """Per-worker counters and gauges read from the registries when Prometheus scrapes; in PD
    mode every series also has a `role` label (prefill / decode)."""

    def __init__(self, groups: list[WorkerGroup], tree_size: Callable[[str], int]) -> None:
        self._groups = groups
        self._tree_size = tree_size
        self._labels = ["worker", "role"] if any(g.role for g in groups) else ["worker"]

    def collect(self):  # noqa: D102 - prometheus-client interface
        labels = self._labels
        routed = CounterMetricFamily(
            PREFIX + "requests", "Requests sent to the worker (retries included)", labels=labels
        )
        retries = CounterMetricFamily(
            PREFIX + "retries",
            "Requests moved to another worker after this one failed them",
            labels=labels,
        )
        decisions = CounterMetricFamily(
            PREFIX + "decisions",
            "Routing decisions by kind: prefix_match, low_match (least load), imbalance "
            "(cache_aware); round_robin; least_load",
            labels=[*labels, "kind"],
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "in_flight_requests", "Requests in flight on the worker", labels=labels
        )
        healthy = GaugeMetricFamily(
            PREFIX + "worker_healthy", "1 if the worker gets traffic, else 0", labels=labels
        )
        tree = GaugeMetricFamily(
            PREFIX + "tree_size",
            "Characters (or token ids) of prefixes the router attributes to the worker",
            labels=labels,
        )
        for group in self._groups:
            for w in group.registry.all_workers():
                values = [w.url, group.role or ""][: len(labels)]
                routed.add_metric(values, w.routed)
                retries.add_metric(values, w.retries)
                for kind, n in sorted(w.decisions.items()):
                    decisions.add_metric([*values, kind], n)
                in_flight.add_metric(values, w.in_flight)
                healthy.add_metric(values, 1 if w.healthy else 0)
                tree.add_metric(values, self._tree_size(w.url))
        yield from (routed, retries, decisions, in_flight, healthy, tree)


class RouterMetrics:
    """The router's Prometheus registry."""

    def __init__(self, groups: list[WorkerGroup], tree_size: Callable[[str], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(groups, tree_size))

    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        return generate_latest(self.registry)
