"""The FastAPI application: routes, error handlers and the ASGI middlewares around them."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

import sglite
from sglite.http.errors import install_error_handlers
from sglite.http.middleware import (
    PUBLIC_PATHS,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HTTPCountMiddleware,
    JSONBodyMiddleware,
)
from sglite.http.streaming import ClientDisconnected
from sglite.runtime.server import (
    embeddings_api,
    native_api,
    openai_api,
    openai_chat,
    responses_api,
    web_ui,
)
from sglite.runtime.server.errors import bad_request
from sglite.runtime.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    """The HTTP app serving `state`'s runtime."""
    app = FastAPI(
        title="sglite",
        version=sglite.__version__,
        description="SGLang-compatible native API and OpenAI-compatible API (`/v1`).",
    )
    app.state.sglite = state
    install_error_handlers(app, bad_request)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(openai_chat.router)
    app.include_router(embeddings_api.router)
    app.include_router(responses_api.router)
    app.include_router(web_ui.api_router)
    public = PUBLIC_PATHS
    if not state.args.disable_web_ui:
        app.include_router(web_ui.page_router)
        public = public | web_ui.PAGE_PATHS  # the page shell holds no data; its calls need keys
    routes = frozenset(
        native_api.route_paths()
        | openai_api.route_paths()
        | openai_chat.route_paths()
        | embeddings_api.route_paths()
        | responses_api.route_paths()
        | web_ui.route_paths()
    )
    # Added last runs first: count -> CORS -> API key -> body limit -> JSON body -> routes.
    app.add_middleware(JSONBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=state.args.max_request_body_bytes)
    if state.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.args.api_key, public=public)
    if state.args.allow_origins:  # off by default: browsers may not call the API cross-site
        origins = [o.strip() for o in state.args.allow_origins.split(",") if o.strip()]
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in origins,
        )
    app.add_middleware(HTTPCountMiddleware, count=state.metrics.count_http, routes=routes)
    return app
