"""The router's HTTP app: the workers' native and OpenAI APIs, plus worker management.

Generation routes (`/generate`, `/v1/completions`, `/v1/chat/completions`) are routed by the
policy on the request's text; info and tokenizer routes go to the least-loaded healthy worker;
`/flush_cache` goes to every healthy worker. Errors have the workers' OpenAI shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import sglite
from sglite.router import keys as routing_keys
from sglite.router.args import RouterArgs
from sglite.router.forward import FORWARDED_HEADERS, Forwarder, Upstream, pick_headers
from sglite.router.metrics import RouterMetrics
from sglite.router.policy import CacheAware, Policy, make_policy
from sglite.router.radix_tree import Key
from sglite.router.workers import Worker, WorkerRegistry
from sglite.runtime.server.app import BodyLimitMiddleware
from sglite.runtime.server.errors import APIError, install_error_handlers
from sglite.runtime.server.streaming import ClientDisconnected, run_until_disconnect

logger = logging.getLogger("sglite.router")

# Routes passed to one worker as they are (no routing key: they gain little from a cache).
PASSTHROUGH_GET = ("/health_generate", "/get_model_info", "/model_info", "/v1/models")
PASSTHROUGH_POST = (
    "/encode", "/v1/embeddings", "/v1/rerank", "/tokenize", "/detokenize", "/v1/tokenize",
    "/v1/detokenize", "/concate_and_append_request",
)  # fmt: skip
# Generation routes and how to find their routing keys.
GENERATION_ROUTES: dict[str, Callable[[dict[str, Any]], list[Key]]] = {
    "/generate": routing_keys.generate_keys,
    "/v1/completions": routing_keys.completion_keys,
    "/v1/chat/completions": routing_keys.chat_keys,
}


@dataclass
class RouterState:
    """Everything one router owns; `app.state.router` holds it."""

    args: RouterArgs
    client: httpx.AsyncClient
    registry: WorkerRegistry
    policy: Policy
    forwarder: Forwarder
    metrics: RouterMetrics

    def tree_size(self, url: str) -> int:
        """Items the cache_aware tree attributes to `url` (0 for other policies)."""
        return tree_size_of(self.policy, url)

    def describe(self, worker: Worker) -> dict[str, Any]:
        """A worker as /list_workers shows it."""
        return {
            "url": worker.url,
            "healthy": worker.healthy,
            "load": worker.in_flight,
            "routed": worker.routed,
            "retries": worker.retries,
            "tree_size": self.tree_size(worker.url),
            "decisions": dict(worker.decisions),
            "last_error": worker.last_error,
        }


def tree_size_of(policy: Policy, url: str) -> int:
    """Items `policy`'s tree attributes to `url` (0 for policies without a tree)."""
    return policy.tree.size(url) if isinstance(policy, CacheAware) else 0


def build_state(args: RouterArgs) -> RouterState:
    """The router's parts for `args` (validated); workers start down until checked."""
    args.validate()
    policy = make_policy(args.policy, args.cache_aware_config())
    timeout = httpx.Timeout(
        connect=args.connect_timeout, read=args.request_timeout,
        write=args.request_timeout, pool=args.request_timeout,
    )  # fmt: skip
    # Idle connections are dropped well before a worker's own 5 s keep-alive ends, so the router
    # rarely sends on a socket the worker is closing (which would look like a failed worker).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2)
    client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
    registry = WorkerRegistry(
        client,
        health_timeout=args.health_check_timeout,
        failure_threshold=args.health_failure_threshold,
        on_down=policy.forget,
    )
    for url in args.worker_urls:
        registry.add(url)
    forwarder = Forwarder(registry, policy, client, args.max_retries)
    metrics = RouterMetrics(registry, lambda url: tree_size_of(policy, url))
    return RouterState(args, client, registry, policy, forwarder, metrics)


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def _json_body(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its JSON object; APIError 400 if it is not a JSON object."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is missing; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and absurdly deep nesting
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return raw, body


def _upstream(request: Request, body: bytes, keys: list[Key] | tuple[Key, ...] = ()) -> Upstream:
    headers = pick_headers(request.headers, FORWARDED_HEADERS)
    if body:
        headers["content-type"] = "application/json"
    query = request.url.query
    path = request.url.path + (f"?{query}" if query else "")
    return Upstream(request.method, path, body, headers, tuple(keys))


async def _generation(request: Request) -> Response:
    state = _state(request)
    raw, body = await _json_body(request)
    up = _upstream(request, raw, GENERATION_ROUTES[request.url.path](body))
    stream = body.get("stream") is True
    work = state.forwarder.forward_stream(up) if stream else state.forwarder.forward(up)
    # A client gone before the answer (or a stream's first event) cancels the work, which
    # closes the worker connection, so the worker aborts the request too.
    return await run_until_disconnect(request, work)


async def _passthrough(request: Request) -> Response:
    body = await request.body()
    up = _upstream(request, body)
    return await run_until_disconnect(request, _state(request).forwarder.forward(up, False))


async def health(request: Request) -> Response:
    """200 while at least one worker is healthy, else 503."""
    if _state(request).registry.healthy_workers():
        return PlainTextResponse("OK\n")
    raise APIError(503, "no healthy worker is available", code="no_healthy_worker")


async def server_info(request: Request) -> Response:
    """One healthy worker's /get_server_info, plus a `router` section (policy, workers)."""
    state = _state(request)
    answer = await state.forwarder.forward(_upstream(request, b""), routed=False)
    if answer.status_code != 200:
        return answer
    try:
        info = json.loads(answer.body)
    except ValueError:
        return answer
    info["router"] = {
        "policy": state.policy.name,
        "workers": [state.describe(w) for w in state.registry.all_workers()],
        "version": sglite.__version__,
    }
    return JSONResponse(info)


async def flush_cache(request: Request) -> Response:
    """Flush every healthy worker's cache (and the router's tree of it); 400 if one refused."""
    state = _state(request)
    workers = state.registry.healthy_workers()
    if not workers:
        raise APIError(503, "no healthy worker is available", code="no_healthy_worker")
    headers = pick_headers(request.headers, FORWARDED_HEADERS)

    async def flush(worker: Worker) -> str | None:
        try:
            answer = await state.client.post(worker.url + "/flush_cache", headers=headers)
        except httpx.HTTPError as exc:
            return f"{worker.url}: {type(exc).__name__}"
        if answer.status_code != 200:
            return f"{worker.url}: {answer.status_code} {answer.text.strip()[:200]}"
        state.policy.forget(worker.url)
        return None

    failures = [f for f in await asyncio.gather(*(flush(w) for w in workers)) if f]
    if failures:
        raise APIError(400, "the cache was not flushed on every worker: " + "; ".join(failures))
    return PlainTextResponse("Cache flushed.\n")


async def add_worker(request: Request, url: str | None = None) -> Response:
    """Register a worker (`?url=`); it gets traffic once it answers /health."""
    state = _state(request)
    if not url:
        raise APIError(400, "url: give the worker as ?url=http://host:port", param="url")
    worker = state.registry.add(url)  # ValueError -> 400
    await state.registry.check(worker)
    logger.warning("worker %s added (healthy: %s)", worker.url, worker.healthy)
    return JSONResponse({"message": f"added worker {worker.url}", "worker": state.describe(worker)})


async def remove_worker(request: Request, url: str | None = None) -> Response:
    """Unregister a worker (`?url=`); its requests in flight finish, nothing new goes there."""
    state = _state(request)
    if not url:
        raise APIError(400, "url: give the worker as ?url=http://host:port", param="url")
    try:
        worker = state.registry.remove(url)
    except KeyError:
        raise APIError(404, f"no worker {url} is registered", param="url") from None
    logger.warning("worker %s removed", worker.url)
    return JSONResponse(
        {"message": f"removed worker {worker.url}", "worker": state.describe(worker)}
    )


async def list_workers(request: Request) -> Response:
    """Every worker with its health, load, requests routed and tree size."""
    state = _state(request)
    workers = state.registry.all_workers()
    return JSONResponse(
        {
            "policy": state.policy.name,
            "urls": [w.url for w in workers],  # SGLang router's field
            "workers": [state.describe(w) for w in workers],
        }
    )


async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(state: RouterState) -> FastAPI:
    """The router's app; its lifespan probes the workers, runs health checks and closes the
    HTTP client."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.registry.check_all()
        checks = asyncio.create_task(
            state.registry.run_health_checks(state.args.health_check_interval)
        )
        try:
            yield
        finally:
            checks.cancel()
            with suppress(asyncio.CancelledError):
                await checks
            await state.client.aclose()

    app = FastAPI(
        title="sglite router",
        version=sglite.__version__,
        description="Routes SGLang native and OpenAI API requests to sglite workers.",
        lifespan=lifespan,
    )
    app.state.router = state
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    for path in GENERATION_ROUTES:
        app.add_api_route(path, _generation, methods=["POST"], include_in_schema=False)
    app.add_api_route("/generate", _generation, methods=["PUT"], include_in_schema=False)
    for path in PASSTHROUGH_GET:
        app.add_api_route(path, _passthrough, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _passthrough, methods=["GET"])
    for path in PASSTHROUGH_POST:
        app.add_api_route(path, _passthrough, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])
    app.add_api_route("/add_worker", add_worker, methods=["POST"])
    app.add_api_route("/remove_worker", remove_worker, methods=["POST"])
    app.add_api_route("/list_workers", list_workers, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_middleware(BodyLimitMiddleware, limit=state.args.max_request_body_bytes)
    return app
