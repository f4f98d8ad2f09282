"""How the server is doing, in SGLang's native API: `/health`, `/health_generate`,
`/get_model_info` (alias `/model_info`), `/get_server_info` (alias `/server_info`) and the
Prometheus `/metrics`.

Invariants: `/health` needs no API key (see `sglite.http.middleware.PUBLIC_PATHS`) and asks the
scheduler nothing; a dead or hung scheduler makes the info and health routes answer 503.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import sglite
from sglite.http.errors import APIError
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.native_protocol import ModelInfo, ServerInfo
from sglite.runtime.server.scheduler_control import control_or_503
from sglite.runtime.server.serving import get_state, raise_if_aborted
from sglite.runtime.server.state import ServerState

router = APIRouter()


@router.get("/health", response_class=Response, responses=error_responses(503))
async def health(request: Request) -> Response:
    """200 while the server can serve (no API key needed)."""
    get_state(request).check_alive()
    return Response(status_code=200)


@router.get("/health_generate", response_class=Response, responses=error_responses(401, 503))
async def health_generate(request: Request) -> Response:
    """200 when a one-token generation succeeds within 30 seconds."""
    state = get_state(request)
    state.check_alive()
    tm = state.tokenizer_manager
    reqs, _ = tm.normalize(
        "Hi", {"max_new_tokens": 1, "temperature": 0}, rid=f"health-{uuid.uuid4().hex}"
    )
    try:
        results = await asyncio.wait_for(tm.generate(reqs), timeout=30)
    except asyncio.TimeoutError:
        raise APIError(503, "health check: no token within 30 seconds") from None
    raise_if_aborted(state, results[0])
    return Response(status_code=200)


def _model_info(state: ServerState) -> dict[str, Any]:
    info = state.client.info
    return ModelInfo(
        model_path=state.model_path,
        tokenizer_path=state.args.tokenizer_path or state.model_path,
        is_generation=True,
        served_model_name=state.model_name,
        context_length=state.context_length,
        vocab_size=info["vocab_size"],
        architecture=info.get("architecture"),
        dtype=info.get("dtype"),
        device=info.get("device"),
    ).model_dump()


@router.get("/get_model_info", response_model=ModelInfo, responses=error_responses(401))
async def get_model_info(request: Request) -> dict[str, Any]:
    """The model's path (SGLang's client picks its chat template from it) and facts."""
    return _model_info(get_state(request))


@router.get("/model_info", response_model=ModelInfo, include_in_schema=False)
async def model_info(request: Request) -> dict[str, Any]:
    """Alias of /get_model_info."""
    return _model_info(get_state(request))


async def _server_info(state: ServerState) -> dict[str, Any]:
    state.check_alive()
    live = await control_or_503(state, "get_info")
    try:
        invariants: dict[str, Any] = {"ok": True, **await state.control("check_invariants")}
    except Exception as exc:  # report a leak instead of failing the info request
        invariants = {"ok": False, "error": str(exc)}
    return {
        **state.public_args(),
        **state.client.info,
        **live,
        "served_model_name": state.model_name,
        "num_in_flight_reqs": state.tokenizer_manager.num_in_flight,
        "scheduler_restarts": state.scheduler_restarts,
        # asyncio tasks alive on the server loop: a leak check for long runs
        "num_server_tasks": len(asyncio.all_tasks()),
        "kv_invariants": invariants,
        "internal_states": [live],
        "version": sglite.__version__,
    }


@router.get("/get_server_info", response_model=ServerInfo, responses=error_responses(401, 503))
async def get_server_info(request: Request) -> JSONResponse:
    """Server arguments, model facts, live statistics and the KV slot accounting check."""
    return JSONResponse(await _server_info(get_state(request)))


@router.get("/server_info", include_in_schema=False)
async def server_info(request: Request) -> JSONResponse:
    """Alias of /get_server_info."""
    return JSONResponse(await _server_info(get_state(request)))


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"description": "the Prometheus text exposition format"},
        **error_responses(401, plain=True),
    },
)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    state = get_state(request)
    payload = await asyncio.to_thread(state.metrics.render)
    return Response(payload, media_type=CONTENT_TYPE_LATEST)
