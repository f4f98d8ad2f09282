"""The router's workers: who they are, whether they are up, how busy they are.

A worker is marked down after `failure_threshold` failed health checks in a row, or at once when
the router cannot connect to it; a down worker gets no traffic and comes back on its first
healthy answer. Everything here runs on the router's event loop, so counters are plain ints.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger("sglite.router")


@dataclass(eq=False)
class Worker:
    """One `sglite serve` process behind the router, with the router's view of it."""

    url: str
    healthy: bool = False
    in_flight: int = 0  # requests sent and not yet answered (streams: until their last byte)
    routed: int = 0  # requests sent, retries included
    retries: int = 0  # requests moved to another worker after this one failed them
    health_failures: int = 0  # failed health checks in a row
    decisions: Counter[str] = field(default_factory=Counter)  # routing decisions by kind
    last_error: str | None = None


def normalize_url(url: str) -> str:
    """`http(s)://host[:port]` without a trailing slash; ValueError for anything else."""
    text = (url or "").strip().rstrip("/")
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"url: not a valid URL ({exc}): {url!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"url must look like http://host:port (got {url!r})")
    if parsed.path not in ("", "/") or parsed.query:
        raise ValueError(f"url must have no path or query (got {url!r})")
    return text


class WorkerRegistry:
    """The workers in registration order, their health, and the health-check loop.

    Invariant: a worker is in `healthy_workers()` iff `healthy` is set; `on_down(url)` is called
    each time a worker is marked down or removed (the policy forgets what it had cached). With an
    `admit` hook, a down worker that answers /health is put in rotation only if `admit(worker)`
    also says yes (PD mode: it is a server of the expected role).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        health_timeout: float,
        failure_threshold: int,
        on_down: Callable[[str], None],
        admit: Callable[[Worker], Awaitable[bool]] | None = None,
    ) -> None:
        self._client = client
        self._health_timeout = health_timeout
        self._failure_threshold = failure_threshold
        self._on_down = on_down
        self._admit = admit
        self._workers: dict[str, Worker] = {}

    def add(self, url: str) -> Worker:
        """Register a worker (down until its first health check passes); ValueError for a bad
        or already registered URL."""
        url = normalize_url(url)
        if url in self._workers:
            raise ValueError(f"url: worker {url} is already registered")
        worker = Worker(url)
        self._workers[url] = worker
        return worker

    def remove(self, url: str) -> Worker:
        """Unregister a worker (requests in flight on it finish); KeyError if unknown."""
        worker = self._workers.pop(normalize_url(url))
        worker.healthy = False
        self._on_down(worker.url)
        return worker

    def get(self, url: str) -> Worker | None:
        """The worker registered under `url`, if any."""
        return self._workers.get(url)

    def all_workers(self) -> list[Worker]:
        """Every registered worker, in registration order."""
        return list(self._workers.values())

    def healthy_workers(self) -> list[Worker]:
        """The workers that may get traffic, in registration order."""
        return [w for w in self._workers.values() if w.healthy]

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Take `worker` out of rotation (no-op if already down or removed)."""
        worker.last_error = reason
        if worker.healthy and self._workers.get(worker.url) is worker:
            worker.healthy = False
            logger.warning("worker %s is down: %s", worker.url, reason)
            self._on_down(worker.url)

    def mark_up(self, worker: Worker) -> None:
        """Put `worker` back in rotation after a healthy answer."""
        worker.health_failures = 0
        if not worker.healthy and self._workers.get(worker.url) is worker:
            worker.healthy = True
            worker.last_error = None
            logger.info("worker %s is healthy", worker.url)

    async def probe(self, worker: Worker) -> bool:
        """GET the worker's /health once: True on 200, never raises."""
        try:
            response = await self._client.get(worker.url + "/health", timeout=self._health_timeout)
        except httpx.HTTPError as exc:
            worker.last_error = f"health check failed: {type(exc).__name__}: {exc}"
            return False
        if response.status_code != 200:
            worker.last_error = f"health check answered {response.status_code}"
            return False
        return True

    async def check(self, worker: Worker) -> None:
        """Probe one worker and update its state by the failure threshold."""
        if await self.probe(worker) and await self._admitted(worker):
            self.mark_up(worker)
            return
        worker.health_failures += 1
        if worker.health_failures >= self._failure_threshold:
            self.mark_down(worker, worker.last_error or "health check failed")

    async def _admitted(self, worker: Worker) -> bool:
        # Asked only on the way up: a healthy worker was admitted already, and asking again on
        # every health check would cost a request per worker and round for nothing.
        return worker.healthy or self._admit is None or await self._admit(worker)

    async def check_all(self) -> None:
        """Probe every worker concurrently."""
        await asyncio.gather(*(self.check(w) for w in self.all_workers()))

    async def run_health_checks(self, interval: float) -> None:
        """Check every worker each `interval` seconds, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking for good
                logger.exception("health check round failed")


@dataclass(frozen=True)
class WorkerGroup:
    """Workers of one role: every worker outside PD mode (`role` None), else the prefill or the
    decode workers (`role` "prefill" / "decode"), each group with its own registry."""

    role: str | None
    registry: WorkerRegistry
