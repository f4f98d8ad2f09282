"""The native API, compatible with SGLang's server (`sglang.RuntimeEndpoint` speaks it).

Routes: /generate, /health, /health_generate, /get_model_info, /get_server_info, /flush_cache,
/concate_and_append_request, /encode, /tokenize, /detokenize, /metrics. Shapes are in
`docs/server.md` and `native_protocol.py`.

This module assembles one router from the route modules, each with one job: `native_generate.py`
(generation), `native_status.py` (health, model and server info, metrics), `native_cache.py`
(cache control) and `native_text.py` (tokenize, detokenize, parse function calls).
"""

from __future__ import annotations

from fastapi import APIRouter

from sglite.runtime.server import native_cache, native_generate, native_status, native_text
from sglite.runtime.server.native_cache import concate_and_append_request, flush_cache
from sglite.runtime.server.native_generate import generate

# The route modules, in the order their routes are listed in the OpenAPI schema.
_PARTS = (native_generate, native_status, native_cache, native_text)

router = APIRouter()
for _part in _PARTS:
    router.include_router(_part.router)

# SGLang also serves these with other methods; registered apart so the OpenAPI schema keeps one
# operation (and one operation id) per route.
for _path, _endpoint, _method in (
    ("/generate", generate, "PUT"),
    ("/flush_cache", flush_cache, "GET"),
    ("/concate_and_append_request", concate_and_append_request, "GET"),
):
    router.add_api_route(_path, _endpoint, methods=[_method], include_in_schema=False)


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels); the routes added here share
    their paths with the route modules' routes."""
    return {route.path for part in _PARTS for route in part.router.routes}
