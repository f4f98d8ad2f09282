"""ASGI middlewares of the server and the router: API key, JSON bodies, body size limit,
answer counts."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglite.http.errors import error_body
from sglite.http.streaming import to_json

# Routes that never need the API key (load balancers probe them without credentials).
PUBLIC_PATHS = frozenset({"/health"})


async def send_error(
    send: Send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]]
) -> None:
    """Answer with an OpenAI-shaped JSON error from a raw ASGI middleware (before FastAPI)."""
    body = to_json(error_body(status, message, code=code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on every route but `public` ones (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str, public: frozenset[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
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
        await send_error(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])


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


class BodyLimitMiddleware:
    """Refuse request bodies over `limit` bytes with 413, before the app parses any of it.

    A declared Content-Length over the limit is refused without reading; a chunked body is read
    up to the limit and refused once it passes it (then replayed to the app when it fits).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        message = f"the request body is larger than {self.limit} bytes (--max-request-body-bytes)"
        await send_error(send, 413, message, "request_too_large", [(b"connection", b"close")])


class HTTPCountMiddleware:
    """Report each answer's route and status to `count` (for /metrics; unknown paths share the
    label "other", so a client probing random paths cannot grow the label set)."""

    def __init__(
        self, app: ASGIApp, count: Callable[[str, int], None], routes: frozenset[str]
    ) -> None:
        self.app = app
        self.count = count
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(route, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
