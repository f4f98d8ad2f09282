"""The FastAPI application: routes, error handlers and the ASGI middlewares around them."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import sglite
from sglite.runtime.server import native_api, openai_api
from sglite.runtime.server.errors import error_body, install_error_handlers
from sglite.runtime.server.state import ServerState
from sglite.runtime.server.streaming import ClientDisconnected, to_json

# Routes that never need the API key (load balancers probe them without credentials).
PUBLIC_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on every route but /health (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if not token:
            token = headers.get(b"x-api-key", b"")
        if token and hmac.compare_digest(token, self._key):
            await self.app(scope, receive, send)
            return
        message = (
            "invalid API key" if token else "missing API key: send Authorization: Bearer <key>"
        )
        body = to_json(error_body(401, message, code="invalid_api_key")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class JSONBodyMiddleware:
    """Treat request bodies as JSON when the client did not say so.

    `curl -d '{...}'` labels its body form-encoded; the API only takes JSON, so reading it as JSON
    is the helpful interpretation (FastAPI would otherwise report the body missing).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT"):
            headers = list(scope.get("headers") or [])
            ctype = next((v for k, v in headers if k == b"content-type"), b"")
            if b"json" not in ctype.lower() and b"multipart" not in ctype.lower():
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                headers.append((b"content-type", b"application/json"))
                scope = dict(scope, headers=headers)
        await self.app(scope, receive, send)


class HTTPCountMiddleware:
    """Count answers per route and status for /metrics (unknown paths share one label)."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.state.metrics.count_http(route, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(state: ServerState) -> FastAPI:
    """The HTTP app serving `state`'s runtime."""
    app = FastAPI(
        title="sglite",
        version=sglite.__version__,
        description="SGLang-compatible native API and OpenAI-compatible API (`/v1`).",
    )
    app.state.sglite = state
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    routes = frozenset(native_api.route_paths() | openai_api.route_paths())
    app.add_middleware(HTTPCountMiddleware, state=state, routes=routes)
    app.add_middleware(JSONBodyMiddleware)
    if state.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.args.api_key)
    return app
