"""Forwarding one request to a worker, with retries so that a dying worker loses nothing.

What is retried on another worker, and why:
- no connection (refused, connect timeout): the worker is gone; it is marked down at once;
- the connection dropped before the answer was complete (reset, closed): the worker is probed
  at once and marked down if it does not answer; the request was not answered, so it is re-sent;
- 502 / 503 (shutting down, scheduler died, overloaded): retried while an untried worker is left.
Never retried: 4xx (the request is at fault, and the worker's answer is forwarded as-is), 500 (a
bug tied to the request), 504 and a read timeout (the request is too long, re-running it doubles
the cost). A stream is committed once its first event has been relayed; a failure after that
ends it with an SSE error event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from sglite.http.errors import APIError, error_body
from sglite.http.streaming import SSE_DONE, SSE_HEADERS, sse
from sglite.load_balancing.policy import Candidate, Policy, least_loaded
from sglite.load_balancing.radix_tree import Key
from sglite.router.workers import Worker, WorkerRegistry

logger = logging.getLogger("sglite.router")

RETRIABLE_STATUSES = frozenset({502, 503})
# Request headers passed on to workers (an API key the workers require travels through).
FORWARDED_HEADERS = ("authorization", "x-api-key", "content-type", "accept")
# Answer headers passed back to the client.
RETURNED_HEADERS = ("content-type", "retry-after", "www-authenticate")


class AttemptFailed(Exception):
    """An attempt on one worker failed in a way another worker may not (a transport failure,
    or a 502/503 answer); `reason` says how. `response` is the worker's own answer, given to the
    client if no other worker is left (None: no answer, the connection failed)."""

    def __init__(self, reason: str, response: Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response


@dataclass(frozen=True)
class Upstream:
    """Where a request goes: method, path, body and the client headers to pass on."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    keys: tuple[Key, ...] = ()  # routing keys: the first decides, all are recorded


def pick_headers(headers: dict[str, str] | httpx.Headers, names: tuple[str, ...]) -> dict[str, str]:
    """The headers among `names` that are present (names compared case-insensitively)."""
    lower = {k.lower(): v for k, v in headers.items()}
    return {n: lower[n] for n in names if n in lower}


class Forwarder:
    """Chooses workers through the policy and relays requests, keeping in-flight loads right.

    Invariant: a worker's `in_flight` counts exactly the requests (and open streams) this
    router has sent it and not finished relaying, whatever way they end.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        client: httpx.AsyncClient,
        max_retries: int,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.client = client
        self.max_retries = max_retries

    def choose(self, keys: tuple[Key, ...], tried: set[str], routed: bool = True) -> Worker:
        """A healthy worker for a request, preferring ones not yet tried: by the policy (and the
        decision recorded) if `routed`, else simply the least loaded (info and tokenizer
        routes, which touch no cache). Raises APIError 503 if no worker is healthy."""
        healthy = self.registry.healthy_workers()
        if not healthy:
            raise APIError(503, "no healthy worker is available", code="no_healthy_worker")
        fresh = [w for w in healthy if w.url not in tried] or healthy
        candidates = [Candidate(w.url, w.in_flight, w.routed) for w in fresh]
        if not routed:
            url = least_loaded(candidates, {}).url
            return next(w for w in fresh if w.url == url)
        decision = self.policy.select(candidates, keys[0] if keys else None)
        worker = next(w for w in fresh if w.url == decision.url)
        self.policy.routed(worker.url, list(keys))
        worker.routed += 1
        worker.decisions[decision.kind] += 1
        return worker

    async def forward(self, up: Upstream, routed: bool = True) -> Response:
        """Send `up` to a worker and return its answer (retrying on another as documented);
        `routed=False` skips the policy (routes that touch no cache)."""
        return await self._with_retries(up, self.attempt, routed)

    async def forward_stream(self, up: Upstream) -> Response:
        """Like `forward` for `stream: true`: returns the worker's SSE stream relayed event by
        event, once its first event arrived (failures before that are retried)."""
        return await self._with_retries(up, self.open_stream, routed=True)

    async def _with_retries(
        self,
        up: Upstream,
        attempt: Callable[[Worker, Upstream], Awaitable[Response]],
        routed: bool,
    ) -> Response:
        tried: set[str] = set()
        last: AttemptFailed | None = None
        for _ in range(self.max_retries + 1):
            if last is not None and last.response is not None and not self._has_untried(tried):
                return last.response  # e.g. an overloaded worker's 503, and nobody else to ask
            worker = self.choose(up.keys, tried, routed)
            tried.add(worker.url)
            try:
                return await attempt(worker, up)
            except AttemptFailed as retry:
                worker.retries += 1
                last = retry
                logger.info("retrying %s %s elsewhere: %s", up.method, up.path, retry.reason)
        return self._gave_up(last)

    # ------------------------------------------------------------------ one attempt
    def _has_untried(self, tried: set[str]) -> bool:
        return any(w.url not in tried for w in self.registry.healthy_workers())

    def _gave_up(self, last: AttemptFailed | None) -> Response:
        if last is not None and last.response is not None:
            return last.response
        reason = last.reason if last else "no attempt was made"
        raise APIError(503, f"no worker could serve the request ({reason})", code="worker_failed")

    def _request(self, worker: Worker, up: Upstream) -> httpx.Request:
        return self.client.build_request(
            up.method, worker.url + up.path, content=up.body, headers=up.headers
        )

    async def attempt(self, worker: Worker, up: Upstream) -> Response:
        """Send `up` to `worker` once and return its whole answer; AttemptFailed for a
        transport failure or a 502/503, APIError 504 for a timeout. The worker's in_flight
        covers the call, and a failed connection marks it down (or probes it)."""
        worker.in_flight += 1
        try:
            answer = await self.client.send(self._request(worker, up))
        except httpx.HTTPError as exc:
            raise await self._transport_failure(worker, exc) from None
        finally:
            worker.in_flight -= 1
        response = _relay(answer.status_code, answer.headers, answer.content)
        if answer.status_code in RETRIABLE_STATUSES:
            raise AttemptFailed(f"{worker.url} answered {answer.status_code}", response)
        return response

    async def open_stream(self, worker: Worker, up: Upstream) -> Response:
        """Send a `stream: true` request to `worker` once: its SSE stream (a RelayedStream,
        returned once the first event arrived, which owns the worker's in_flight until it is
        closed) or its non-SSE answer; failures as `attempt`."""
        worker.in_flight += 1
        answer: httpx.Response | None = None
        handed_over = False  # once the stream is returned, its on_close owns the clean-up
        try:
            answer = await self.client.send(self._request(worker, up), stream=True)
            is_sse = answer.headers.get("content-type", "").startswith("text/event-stream")
            if answer.status_code == 200 and is_sse:
                events = sse_events(answer.aiter_raw())
                first = await anext(events, b"")
                handed_over = True
                relay = relay_events(worker, first, events, self._check_after_failure)
                return RelayedStream(relay, on_close=_closer(worker, answer))
            content = await answer.aread()
        except httpx.HTTPError as exc:
            failure: httpx.HTTPError | None = exc
        else:
            failure = None
        finally:
            if not handed_over:
                worker.in_flight -= 1
                if answer is not None:
                    with anyio.CancelScope(shield=True):
                        await answer.aclose()
        if failure is not None:
            raise await self._transport_failure(worker, failure)
        response = _relay(answer.status_code, answer.headers, content)
        if answer.status_code in RETRIABLE_STATUSES:
            raise AttemptFailed(f"{worker.url} answered {answer.status_code}", response)
        return response

    async def _transport_failure(self, worker: Worker, exc: httpx.HTTPError) -> Exception:
        """The exception to raise for a transport error: AttemptFailed, or APIError (timeouts)."""
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            self.registry.mark_down(worker, f"cannot connect: {what}")
            return AttemptFailed(f"cannot connect to {worker.url}: {what}")
        if isinstance(exc, httpx.PoolTimeout):
            return APIError(503, "the router has too many requests in flight", code="overloaded")
        if isinstance(exc, httpx.TimeoutException):
            return APIError(504, f"{worker.url} did not answer in time ({what})", code="timeout")
        await self._check_after_failure(worker, what)
        return AttemptFailed(f"connection to {worker.url} lost: {what}")

    async def _check_after_failure(self, worker: Worker, what: str) -> None:
        """A worker dropped a connection: dead, or just a stale socket? Probe it now."""
        if not await self.registry.probe(worker):
            self.registry.mark_down(worker, f"connection lost: {what}")


def _relay(status: int, headers: httpx.Headers, content: bytes) -> Response:
    return Response(content, status_code=status, headers=pick_headers(headers, RETURNED_HEADERS))


def _closer(worker: Worker, answer: httpx.Response) -> Callable[[], Awaitable[None]]:
    closed = False

    async def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            worker.in_flight -= 1
            with suppress(httpx.HTTPError):
                await answer.aclose()  # unread: closes the connection, so the worker aborts

    return close


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events (`...\\n\\n`) from a byte stream; a torn last event is dropped and
    reported as httpx.ReadError (the worker went away mid-event)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[: end + 2]
            buffer = buffer[end + 2 :]
    if buffer.strip():
        raise httpx.ReadError("the stream ended in the middle of an event")


async def relay_events(
    worker: Worker,
    first: bytes,
    events: AsyncIterator[bytes],
    on_broken: Callable[[Worker, str], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The worker's events, starting with the one already read; a lost worker ends the stream
    with an error event and `[DONE]` (the client has already received part of the answer),
    and `on_broken` checks the worker."""
    if first:
        yield first
    done = first.startswith(b"data: [DONE]")
    try:
        async for event in events:
            done = done or event.startswith(b"data: [DONE]")
            yield event
    except httpx.HTTPError as exc:
        message = f"the worker {worker.url} failed mid-stream ({type(exc).__name__}); retry"
        logger.warning("stream from %s broken: %s", worker.url, exc)
        yield sse(error_body(503, message, code="worker_failed"))
        if not done:
            yield SSE_DONE
        await on_broken(worker, f"{type(exc).__name__}: {exc}")


class RelayedStream(StreamingResponse):
    """An SSE StreamingResponse that always runs its close callbacks, also when the client
    disconnects before the first byte (Starlette then never starts the body iterator, whose own
    `finally` would not run).

    Invariant: the callbacks run exactly once, whether the stream is sent or only `close`d.
    """

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = [on_close]

    def add_close_callback(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` too when the stream closes, after the callbacks given before."""
        self._on_close.append(callback)

    async def close(self) -> None:
        """Run the close callbacks (once): for a stream that will never be sent."""
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            await callback()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()
