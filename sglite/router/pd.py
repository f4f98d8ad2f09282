"""PD disaggregation forwarding: each generation request goes to a prefill worker and a decode
worker at once, and the client gets the decode worker's answer.

The prefill worker (chosen by the router's policy on the routing keys) computes the prompt's KV
cache and hands it to the decode worker (the least loaded) through its bootstrap server; both
copies of the request carry the same `bootstrap_host`, `bootstrap_port` and `bootstrap_room`.
The prefill copy is never streamed and its answer is discarded. How the two outcomes combine:

- the decode's answer (a stream: its first event) is ready first: it goes to the client, whatever
  the prefill does afterwards;
- the prefill fails first (transport error or 5xx): the decode request is cancelled (its
  connection closed, so the decode server aborts it and frees its KV slots); 502 `prefill_failed`;
- the prefill answers 4xx first: the decode's answer if it comes within DECODE_GRACE seconds
  (the decode validates the same body, so it normally refuses too), else the prefill's 4xx;
- the prefill answers 2xx: discarded, the decode's answer is awaited;
- the decode fails (no connection, connection lost before answering): 502 `decode_failed`, and
  the prefill request is cancelled; any answer the decode gives (4xx, 5xx) goes to the client.

A prefill request still running when the decode's answer is complete (a stream: closed) is
cancelled: the decode no longer needs it. Nothing is retried: a failed request fails cleanly and
the client retries.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import Response

from sglite.http.errors import APIError
from sglite.load_balancing.radix_tree import Key
from sglite.router.bootstrap import (
    Bootstrap,
    RoleCheck,
    RoleError,
    bootstrap_host,
    decode_body,
    new_room,
    prefill_body,
)
from sglite.router.forward import AttemptFailed, Forwarder, RelayedStream, Upstream, pick_headers
from sglite.router.workers import Worker

logger = logging.getLogger("sglite.router")

# Seconds the decode's answer is awaited after the prefill refused the request with a 4xx.
DECODE_GRACE = 2.0
# Headers that let the router read a prefill worker's /get_server_info behind an API key.
AUTH_HEADERS = ("authorization", "x-api-key")
# Strong references to tasks that must run to their end (asyncio keeps only weak ones), e.g. a
# cancelled copy's clean-up while the request's own task is being cancelled too.
_tasks: set[asyncio.Future[Any]] = set()


def _start(coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


@dataclass(frozen=True)
class Pair:
    """The two workers of one request."""

    prefill: Worker
    decode: Worker


@dataclass(frozen=True)
class PrefillOutcome:
    """How the prefill copy ended: `failure` says why it failed (transport error or 5xx), else
    `answer` is its answer (2xx: discarded; 4xx: passed on if the decode has none)."""

    answer: Response | None
    failure: str | None = None

    @property
    def refused(self) -> bool:
        """The prefill server answered 4xx: the request is at fault."""
        return self.answer is not None and 400 <= self.answer.status_code < 500


class PDForwarder:
    """Sends each generation request to a prefill and a decode worker and combines the outcomes
    as the module docstring says.

    Invariant: every worker's `in_flight` counts exactly the copies this router sent it and has
    not finished with (`Forwarder.attempt` / `open_stream` keep it; the copies are cancelled, not
    abandoned), whatever way the request ends.
    """

    def __init__(
        self, prefill: Forwarder, decode: Forwarder, roles: RoleCheck, grace: float = DECODE_GRACE
    ) -> None:
        self.prefill = prefill  # over the prefill workers, with the router's policy
        self.decode = decode  # over the decode workers, with LeastLoad
        self.roles = roles  # the prefill workers' bootstrap ports
        self.grace = grace

    def choose(self, keys: tuple[Key, ...]) -> Pair:
        """A prefill worker by the policy and a decode worker by load (decisions recorded);
        APIError 503 naming the group that has no healthy worker."""
        for name, forwarder in (("prefill", self.prefill), ("decode", self.decode)):
            if not forwarder.registry.healthy_workers():
                message = f"no healthy {name} worker is available"
                raise APIError(503, message, code="no_healthy_worker")
        return Pair(self.prefill.choose(keys, set()), self.decode.choose((), set()))

    async def forward(self, up: Upstream, body: dict[str, Any], stream: bool) -> Response:
        """The client's answer to generation request `up` (whose JSON object is `body`)."""
        pair = self.choose(up.keys)
        bootstrap = await self._bootstrap(pair.prefill, up.headers)
        prefill_up = replace(up, body=prefill_body(body, bootstrap))
        decode_up = replace(up, body=decode_body(body, bootstrap))
        exchange = _Exchange(
            pair,
            _start(self._send_prefill(pair.prefill, prefill_up)),
            _start(self._send_decode(pair.decode, decode_up, stream)),
            self.grace,
        )
        return await exchange.run()

    async def _bootstrap(self, prefill: Worker, headers: dict[str, str]) -> Bootstrap:
        try:
            port = await self.roles.bootstrap_port(prefill, pick_headers(headers, AUTH_HEADERS))
        except RoleError as exc:
            message = f"the prefill worker {prefill.url} has no bootstrap port: {exc}"
            raise APIError(502, message, code="prefill_failed") from None
        return Bootstrap(bootstrap_host(prefill), port, new_room())

    async def _send_prefill(self, worker: Worker, up: Upstream) -> PrefillOutcome:
        """The prefill copy's outcome; never raises (but for cancellation)."""
        try:
            answer = await self.prefill.attempt(worker, up)
        except AttemptFailed as exc:  # transport failure, or a 502/503 answer
            reason = exc.reason if exc.response is None else _answered(worker, exc.response)
            return PrefillOutcome(exc.response, reason)
        except APIError as exc:  # timeout
            return PrefillOutcome(None, exc.message)
        if answer.status_code >= 500:
            return PrefillOutcome(answer, _answered(worker, answer))
        return PrefillOutcome(answer)

    async def _send_decode(self, worker: Worker, up: Upstream, stream: bool) -> Response:
        """The decode's answer (a stream once its first event arrived); APIError 502 if the
        decode worker gave none."""
        try:
            if stream:
                return await self.decode.open_stream(worker, up)
            return await self.decode.attempt(worker, up)
        except AttemptFailed as exc:
            if exc.response is not None:
                return exc.response  # a 502/503 of the decode server's own: passed on as-is
            message = f"the decode worker {worker.url} failed: {exc.reason}"
            raise APIError(502, message, code="decode_failed") from None


class _Exchange:
    """One request's two copies in flight; `run` gives the client's answer.

    Invariant: when `run` returns or raises, both copies are finished or cancelled, except a
    prefill copy that the returned decode stream cancels when it closes.
    """

    def __init__(
        self,
        pair: Pair,
        prefill: asyncio.Future[PrefillOutcome],
        decode: asyncio.Future[Response],
        grace: float,
    ) -> None:
        self.pair = pair
        self.prefill = prefill
        self.decode = decode
        self.grace = grace

    async def run(self) -> Response:
        answer: Response | None = None
        try:
            answer = await self._outcome()
        finally:
            if isinstance(answer, RelayedStream):
                # No await here: a cancellation now would lose the stream, and with it the
                # only owner of the decode copy's connection and in_flight.
                self._stream_owns_prefill(answer)
            else:  # also on cancellation (the client left) and errors
                await _finish(self._release())
        return answer

    async def _outcome(self) -> Response:
        await asyncio.wait({self.prefill, self.decode}, return_when=asyncio.FIRST_COMPLETED)
        if self.decode.done():
            return self.decode.result()  # APIError if the decode failed
        prefill = self.prefill.result()
        if prefill.failure is not None:
            logger.warning("prefill %s failed: %s", self.pair.prefill.url, prefill.failure)
            message = f"the prefill worker {self.pair.prefill.url} failed: {prefill.failure}"
            raise APIError(502, message, code="prefill_failed")
        if prefill.answer is not None and prefill.refused:
            await asyncio.wait({self.decode}, timeout=self.grace)
            if self.decode.done() and self.decode.exception() is None:
                return self.decode.result()
            return prefill.answer
        await asyncio.wait({self.decode})  # the prefill is done: the decode's answer decides
        return self.decode.result()

    def _stream_owns_prefill(self, stream: RelayedStream) -> None:
        if not self.prefill.done():
            # The decode may still be receiving its KV from this prefill: cancel only at the end.
            stream.add_close_callback(lambda: _cancel(self.prefill))

    async def _release(self) -> None:
        """Cancel both copies; close a decode stream the client does not get."""
        await _cancel(self.decode)
        if _succeeded(self.decode) and isinstance(self.decode.result(), RelayedStream):
            await self.decode.result().close()
        await _cancel(self.prefill)


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel `task` (a no-op once done) and wait until its clean-up (in_flight) has run."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: a failure after the answer was chosen is not news


async def _finish(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to its end even if the caller is cancelled while waiting for it."""
    await asyncio.wait({_start(coro)})


def _answered(worker: Worker, answer: Response) -> str:
    """What the worker answered: `<url> answered <status>: <its error message>`."""
    try:
        message = json.loads(answer.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = bytes(answer.body[:200]).decode(errors="replace").strip()
    return f"{worker.url} answered {answer.status_code}" + (f": {message}" if message else "")
