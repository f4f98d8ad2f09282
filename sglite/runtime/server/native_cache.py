"""Cache control in SGLang's native API: `POST /flush_cache` (also `GET`) and
`POST /concate_and_append_request` (also `GET`).

Invariants: the radix cache is flushed only while no request runs (else 400).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from sglite.http.errors import APIError
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.native_protocol import ConcateAndAppendIn, FlushCacheIn, SuccessOut
from sglite.runtime.server.scheduler_control import control_or_503
from sglite.runtime.server.serving import get_state

router = APIRouter()

# 401 comes from --api-key, 413 from the body size limit.
_BODY_ERRORS = error_responses(400, 401, 413)


@router.post(
    "/flush_cache",
    response_class=PlainTextResponse,
    responses={
        200: {"description": "`Cache flushed.`"},
        **error_responses(
            400, 401, 413, 503, plain=True, descriptions={400: "requests are running"}
        ),
    },
)
async def flush_cache(request: Request, body: FlushCacheIn | None = None) -> PlainTextResponse:
    """Empty the radix cache; refused (400) while requests are running."""
    state = get_state(request)
    state.check_alive()
    try:
        await control_or_503(state, "flush_cache")
    except RuntimeError as exc:
        message = str(exc).split(": ", 1)[-1] if str(exc).startswith("RuntimeError") else str(exc)
        raise APIError(400, f"the cache was not flushed: {message}") from None
    return PlainTextResponse("Cache flushed.\n")


@router.post("/concate_and_append_request", response_model=SuccessOut, responses=_BODY_ERRORS)
async def concate_and_append_request(body: ConcateAndAppendIn) -> SuccessOut:
    """Acknowledge SGLang's join(mode="concate_and_append").

    The client appends the joined text itself and the radix cache already shares it, so there is
    nothing to move on the server.
    """
    return SuccessOut(message=f"appended {len(body.src_rids)} request(s) to {body.dst_rid}")
