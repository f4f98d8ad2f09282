"""Prometheus metrics of one server (`GET /metrics`).

Counters and latency histograms are fed by a TokenizerManager output hook, so every request is
measured the same way whichever route it came through. Scheduler-side state (queue length, pool
usage, cache hit rate) is read from the scheduler when Prometheus scrapes. Each server has its own
registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sglite.runtime.scheduler.io import RequestOutput
from sglite.runtime.scheduler.stats import prometheus_counters

logger = logging.getLogger("sglite.runtime.server")

PREFIX = "sglite:"
# Buckets in seconds; CPU decode steps are tens of milliseconds, prefill up to seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _SchedulerCollector(Collector):
    """Gauges read from the scheduler's live statistics at scrape time."""

    def __init__(self, get_info: Callable[[], dict[str, Any]], num_in_flight: Callable[[], int]):
        self._get_info = get_info
        self._num_in_flight = num_in_flight

    def collect(self):  # noqa: D102 - prometheus-client interface
        try:
            info = self._get_info()
        except Exception as exc:  # a dead scheduler must not break the scrape
            logger.warning("metrics: scheduler info unavailable: %s", exc)
            info = {}
        gauges = [
            ("num_running_reqs", "Requests in the running batch", "num_running_reqs"),
            ("num_queue_reqs", "Requests waiting in the scheduler queue", "num_queued_reqs"),
            ("token_usage", "Fraction of the KV token pool in use", "pool_usage"),
            ("cache_hit_rate", "Prompt tokens served from the radix cache / all", "cache_hit_rate"),
            ("max_total_num_tokens", "KV token pool size", "max_total_num_tokens"),
            ("cache_size_tokens", "Tokens held by the radix cache", "cache_size_tokens"),
        ]
        yield GaugeMetricFamily(
            PREFIX + "num_in_flight_reqs",
            "Requests being served by the HTTP server",
            value=float(self._num_in_flight()),
        )
        for name, doc, key in gauges:
            value = info.get(key)
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        for name, doc in SCHEDULER_COUNTERS:
            if name in info:
                yield CounterMetricFamily(PREFIX + name, doc, value=float(info[name]))
        yield from _tier_metrics(info.get("hicache") or {})


# Scheduler counters: radix cache evictions (the cache's statistics), then every counter of the
# scheduler's `SchedulerStats` that has a help text.
SCHEDULER_COUNTERS = (
    ("evicted_tokens", "Tokens evicted from the radix cache (freed from the KV pool)"),
    *prometheus_counters(),
)


# Per-tier series of the hierarchical cache: (metric, help, key in tier_info, is a counter).
TIER_SERIES = (
    ("hicache_tokens", "Tokens held in the tier", "tokens", False),
    ("hicache_bytes", "Bytes held in the tier", "bytes", False),
    ("hicache_hit_tokens", "Admitted prompt tokens served from the tier", "hit_tokens", True),
    ("hicache_promotions", "Spans loaded from the tier into the pool", "promotions", True),
    ("hicache_promoted_tokens", "Tokens loaded from the tier into the pool", "promoted_tokens",
     True),
    ("hicache_demotions", "Spans written into the tier on eviction from above", "demotions", True),
    ("hicache_stored_tokens", "Tokens written into the tier (demotion or write-through)",
     "stored_tokens", True),
    ("hicache_evicted_tokens", "Tokens dropped from the tier", "evicted_tokens", True),
    ("hicache_bytes_in", "Bytes written into the tier", "bytes_in", True),
    ("hicache_bytes_out", "Bytes read out of the tier", "bytes_out", True),
    ("hicache_skipped_loads", "Spans recomputed because loading would cost more",
     "skipped_loads", True),
    ("hicache_corrupt_pages", "Disk pages that failed their checksum (discarded)",
     "corrupt_pages", True),
)  # fmt: skip


def _tier_metrics(tiers: dict[str, dict[str, Any]]):
    """One labelled family per series, a sample per tier that reports it."""
    if not tiers:
        return
    for name, doc, key, counter in TIER_SERIES:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(PREFIX + name, doc, labels=["tier"])
        seen = False
        for tier, values in tiers.items():
            if key in values:
                family.add_metric([tier], float(values[key]))
                seen = True
        if seen:
            yield family


class ServerMetrics:
    """The metrics of one server; `on_output` is the TokenizerManager hook that feeds them."""

    def __init__(
        self,
        get_info: Callable[[], dict[str, Any]],
        num_in_flight: Callable[[], int],
        model_name: str,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter(
            PREFIX + "num_requests", "Finished requests", labels + ["finish_reason"],
            registry=self.registry,
        )  # fmt: skip
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", labels,
            registry=self.registry,
        )  # fmt: skip
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens", "Prompt tokens served from the radix cache", labels,
            registry=self.registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens", labels, registry=self.registry
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
            buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens", labels,
            buckets=ITL_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish", labels,
            buckets=E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_SchedulerCollector(get_info, num_in_flight))

    def on_output(self, out: RequestOutput, elapsed: float, gap: float | None) -> None:
        """Record one scheduler increment (TokenizerManager output hook)."""
        try:
            n = len(out.new_token_ids)
            if n:
                self.generation_tokens.labels(self._model).inc(n)
                if gap is None:
                    self.ttft.labels(self._model).observe(elapsed)
                else:
                    # Several tokens in one increment arrived together; spread the gap over them.
                    per_token = gap / n
                    hist = self.itl.labels(self._model)
                    for _ in range(n):
                        hist.observe(per_token)
            if out.finish_reason is not None:
                reason = str(out.finish_reason.get("type", "unknown"))
                self.requests.labels(self._model, reason).inc()
                self.prompt_tokens.labels(self._model).inc(out.prompt_tokens)
                self.cached_tokens.labels(self._model).inc(out.cached_tokens)
                self.e2e.labels(self._model).observe(elapsed)
        except Exception:  # metrics must never break a request
            logger.exception("metrics hook failed")

    def count_http(self, route: str, status: int) -> None:
        """Count one HTTP answer."""
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
