"""Server-sent events and client-disconnect handling.

A request whose client has gone must stop at once: aborting it frees its KV slots for everyone
else. Streams notice on their own (the ASGI server cancels them), but a request still queued or a
non-streamed request produces nothing to write, so both race their work against the connection's
`http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable
from contextlib import suppress
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response_content(*event_models: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI `content` entry of a `text/event-stream` answer.

    Each event is `data: {json}` holding one of `event_models` (an error arrives as an
    `ErrorResponse` event), and the stream ends with `data: [DONE]`. `itemSchema` describes one
    event (OpenAPI 3.2's key for streams, which FastAPI also writes for its own SSE routes).
    The payload schemas are inlined: the chunk models are not among the document's components.
    """
    payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [inline_json_schema(m) for m in event_models]},
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}},
    }
    return {"text/event-stream": {"itemSchema": event}}


def inline_json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s serialization JSON schema with every `$ref` replaced by its definition.

    The protocol models are not recursive, so inlining terminates.
    """
    schema = model.model_json_schema(mode="serialization")
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: resolve(v) for k, v in node.items() if k != "$ref"}
            if "$ref" in node:
                out = {**resolve(defs[node["$ref"].rsplit("/", 1)[-1]]), **out}
            return out
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before its answer was ready."""


def to_json(obj: Any) -> str:
    """JSON text; non-finite floats (a -inf logprob) become -9999.0, as JSON has no infinity."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return -9999.0
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def sse(obj: Any) -> bytes:
    """One `data: {json}` event."""
    text = obj if isinstance(obj, str) else to_json(obj)
    return f"data: {text}\n\n".encode()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the request body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Cancelling the TokenizerManager coroutine aborts its scheduler requests.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def iterate_until_disconnect(request: Request, source: AsyncIterator[T]) -> AsyncIterator[T]:
    """Yield from `source` until it ends or the client disconnects; always close `source`."""
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(source.__anext__())
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return  # the client is gone; the clean-up below aborts the request
            pending, step = step, None
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
        # Close in a task of its own: when the ASGI server cancels this generator (client gone),
        # anything awaited here would be cancelled before the request is aborted.
        task = asyncio.ensure_future(_close(step, source))
        _cleanups.add(task)
        task.add_done_callback(_cleanups.discard)


_cleanups: set[asyncio.Future] = set()  # strong references until the clean-ups finish


async def _close(step: asyncio.Future | None, source: AsyncIterator[Any]) -> None:
    if step is not None and not step.done():
        step.cancel()  # raises CancelledError inside `source`, whose finally blocks abort
        with suppress(BaseException):
            await step
    with suppress(Exception):
        await source.aclose()


async def merge_streams(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as their items arrive, tagging each with its source index.

    Closing the merged stream closes every source (so each aborts its request).
    """
    if len(sources) == 1:
        try:
            async for item in sources[0]:
                yield 0, item
        finally:
            await sources[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await queue.put((i, item))
        except Exception as exc:  # surfaced to the consumer below
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task
        for source in sources:
            with suppress(Exception):
                await source.aclose()
