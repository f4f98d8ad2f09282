"""The router's HTTP app: the workers' native and OpenAI APIs, plus worker management.

Generation routes (`/generate`, `/v1/completions`, `/v1/chat/completions`) are routed by the
policy on the request's text (in PD mode: to a prefill and a decode worker, sglite/router/pd.py);
info and tokenizer routes go to the least-loaded healthy (decode) worker; `/flush_cache` goes to
every healthy worker. Errors have the workers' OpenAI shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import sglite
from sglite.http.errors import APIError, install_error_handlers
from sglite.http.middleware import BodyLimitMiddleware
from sglite.http.streaming import ClientDisconnected, run_until_disconnect
from sglite.load_balancing.radix_tree import Key
from sglite.router import keys as routing_keys
from sglite.router.forward import FORWARDED_HEADERS, Upstream, pick_headers
from sglite.router.state import RouterState, build_state
from sglite.router.workers import Worker, normalize_url

__all__ = ["RouterState", "build_state", "create_app"]  # the state's names, as before

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
    if state.pd is not None:
        work = state.pd.forward(up, body, stream)
    else:
        work = state.forwarder.forward_stream(up) if stream else state.forwarder.forward(up)
    # A client gone before the answer (or a stream's first event) cancels the work, which
    # closes the worker connection(s), so the worker(s) abort the request too.
    return await run_until_disconnect(request, work)


async def _passthrough(request: Request) -> Response:
    body = await request.body()
    up = _upstream(request, body)
    return await run_until_disconnect(request, _state(request).forwarder.forward(up, False))


async def health(request: Request) -> Response:
    """200 while every group (all workers; or prefill and decode) has a healthy worker, else
    503 naming the group without one."""
    for group in _state(request).groups:
        if not group.registry.healthy_workers():
            who = f"{group.role} " if group.role else ""
            raise APIError(503, f"no healthy {who}worker is available", code="no_healthy_worker")
    return PlainTextResponse("OK\n")


async def server_info(request: Request) -> Response:
    """One healthy worker's /get_server_info (a decode worker's in PD mode), plus a `router`
    section (policy, workers)."""
    state = _state(request)
    answer = await state.forwarder.forward(_upstream(request, b""), routed=False)
    if answer.status_code != 200:
        return answer
    try:
        info = json.loads(answer.body)
    except ValueError:
        return answer
    info["router"] = _router_info(state)
    return JSONResponse(info)


def _router_info(state: RouterState) -> dict[str, Any]:
    info: dict[str, Any] = {"policy": state.policy.name}
    if state.pd is None:
        info["workers"] = state.describe_all()
    else:
        info["pd_disaggregation"] = True
        for g in state.groups:  # "prefill": [...], "decode": [...]
            info[str(g.role)] = [state.describe(w, g.role) for w in g.registry.all_workers()]
    info["version"] = sglite.__version__
    return info


async def flush_cache(request: Request) -> Response:
    """Flush every healthy worker's cache, of every group (and the router's tree of it); 400 if
    one refused."""
    state = _state(request)
    workers = [w for g in state.groups for w in g.registry.healthy_workers()]
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


async def add_worker(request: Request, url: str | None = None, role: str | None = None) -> Response:
    """Register a worker (`?url=`, and `&role=prefill|decode` in PD mode); it gets traffic once
    it answers /health (and, in PD mode, its /get_server_info shows the role)."""
    state = _state(request)
    if not url:
        raise APIError(400, "url: give the worker as ?url=http://host:port", param="url")
    group = state.group(role)
    other = state.owner(normalize_url(url))  # ValueError -> 400
    if other is not None and other is not group:
        message = f"url: worker {normalize_url(url)} is already registered as a {other.role} worker"
        raise APIError(400, message, param="url")
    worker = group.registry.add(url)  # ValueError -> 400
    await group.registry.check(worker)
    logger.warning("worker %s added (healthy: %s)", worker.url, worker.healthy)
    described = state.describe(worker, group.role)
    return JSONResponse({"message": f"added worker {worker.url}", "worker": described})


async def remove_worker(
    request: Request, url: str | None = None, role: str | None = None
) -> Response:
    """Unregister a worker (`?url=`, and `&role=` in PD mode); its requests in flight finish,
    nothing new goes there."""
    state = _state(request)
    if not url:
        raise APIError(400, "url: give the worker as ?url=http://host:port", param="url")
    group = state.group(role)
    try:
        worker = group.registry.remove(url)
    except KeyError:
        who = f"{group.role} worker" if group.role else "worker"
        raise APIError(404, f"no {who} {url} is registered", param="url") from None
    logger.warning("worker %s removed", worker.url)
    described = state.describe(worker, group.role)
    return JSONResponse({"message": f"removed worker {worker.url}", "worker": described})


async def list_workers(request: Request) -> Response:
    """Every worker with its health, load, requests routed and tree size (and role, PD mode)."""
    state = _state(request)
    workers = state.describe_all()
    listed: dict[str, Any] = {
        "policy": state.policy.name,
        "urls": [w["url"] for w in workers],  # SGLang router's field
        "workers": workers,
    }
    if state.pd is not None:
        listed["pd_disaggregation"] = True
    return JSONResponse(listed)


async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(state: RouterState) -> FastAPI:
    """The router's app; its lifespan probes the workers, runs health checks and closes the
    HTTP client."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registries = [g.registry for g in state.groups]
        await asyncio.gather(*(r.check_all() for r in registries))
        interval = state.args.health_check_interval
        checks = [asyncio.create_task(r.run_health_checks(interval)) for r in registries]
        try:
            yield
        finally:
            for task in checks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
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
