"""The page for people (`/`: chat playground, radix cache view, live metrics) and the JSON
behind its cache view (`/cache/tree`).

The page is static HTML/CSS/JS shipped in the package (`web/`), no build step and no third-party
script. It talks to the server through the same API clients use (`/v1/models`,
`/v1/chat/completions` streamed, `/cache/tree`), so with `--api-key` set it must be given the
key: the page shell is public (it holds no data), every call behind it is not.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from sglite.http.errors import APIError
from sglite.runtime.cache.tree_view import MAX_DEPTH, MAX_NODES, MAX_TEXT_TOKENS, check_bounds
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.scheduler_control import control_or_503
from sglite.runtime.server.serving import get_state

# The page's files: name -> media type. Served from memory, read once per process.
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
# Paths of the page shell (no data in them), public even when an API key is set.
PAGE_PATHS = frozenset({"/", *(f"/ui/{name}" for name in ASSETS)})
# The page may only run its own script and style, talk to its own origin, and show data: images.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

page_router = APIRouter()  # included only when the web UI is on
api_router = APIRouter()


@functools.cache
def _asset(name: str) -> str:
    return resources.files("sglite.runtime.server").joinpath("web", name).read_text("utf-8")


@page_router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> Response:
    """The page: chat, cache view, metrics."""
    return HTMLResponse(
        _asset("index.html"), headers={"content-security-policy": CONTENT_SECURITY_POLICY}
    )


@page_router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    """The page's script and style sheet."""
    if name not in ASSETS:
        raise APIError(404, f"no such file: /ui/{name}")
    return Response(_asset(name), media_type=ASSETS[name])


@api_router.get("/cache/tree", responses=error_responses(400, 401, 503))
async def cache_tree(
    request: Request,
    depth: int = Query(6, description=f"levels below the root, 1-{MAX_DEPTH}"),
    max_nodes: int = Query(200, description=f"most nodes in the answer, 1-{MAX_NODES}"),
    text_tokens: int = Query(24, description=f"tokens decoded per node, 1-{MAX_TEXT_TOKENS}"),
    replica: int = Query(0, description="the data-parallel replica whose tree is drawn"),
) -> JSONResponse:
    """A bounded snapshot of the radix tree: nodes breadth first (most-hit children first) as
    token spans with their text, size, hit count, lock count and tier; the path the latest
    admitted request matched (`highlight`); and the scheduler's live statistics (`stats`, the
    numbers `/metrics` exports)."""
    state = get_state(request)
    try:
        check_bounds(depth, max_nodes, text_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split()[0]) from None
    args: dict[str, Any] = {"depth": depth, "max_nodes": max_nodes, "text_tokens": text_tokens}
    if state.args.dp_size > 1:
        if not 0 <= replica < state.args.dp_size:
            message = f"replica must be between 0 and {state.args.dp_size - 1}"
            raise APIError(400, message, param="replica")
        args["replica"] = replica
    elif replica != 0:
        raise APIError(400, "replica must be 0: the server has one replica", param="replica")
    tree = await control_or_503(state, "cache_tree", **args)
    return JSONResponse({"replica": 0, "replicas": 1, **tree, "model": state.model_name})


def route_paths() -> set[str]:
    """Paths served here (for per-route metrics labels)."""
    return {route.path for route in (*page_router.routes, *api_router.routes)}
