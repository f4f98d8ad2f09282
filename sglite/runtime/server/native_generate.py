"""SGLang's native `POST /generate` (also `PUT`): text for a prompt, a batch of prompts or token
ids, whole or as an event stream of cumulative results.

Invariants: a list-valued per-prompt field holds one entry per prompt (else 400 naming it); a
400 names the field the problem came in; a batch or `n > 1` answers a list (streamed: chunks
tagged with `index`), a single prompt one result.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from sglite.http.errors import APIError, ErrorResponse
from sglite.http.streaming import (
    SSE_HEADERS,
    iterate_until_disconnect,
    run_until_disconnect,
    sse_response_content,
    to_json,
)
from sglite.runtime.constrained.base import GrammarError
from sglite.runtime.multimodal.image_input import ImageInputError
from sglite.runtime.server.errors import bad_request, error_responses
from sglite.runtime.server.native_protocol import (
    GenerateRequestIn,
    GenerateResult,
    SamplingParamsIn,
)
from sglite.runtime.server.serving import (
    bootstrap_of,
    get_state,
    prepare_requests,
    raise_if_aborted,
    stream_events,
)

router = APIRouter()

# Statuses /generate really answers besides 200 (documented in the OpenAPI schema): 401 comes
# from --api-key, 413 from the body size limit, 503 from admission (overload, shutdown, the
# scheduler gone), 504 from --request-timeout.
_GENERATE_ERRORS = error_responses(400, 401, 413, 503, 504)


def _sampling_dicts(
    params: SamplingParamsIn | list[SamplingParamsIn] | None,
) -> dict[str, Any] | list[dict[str, Any]] | None:
    if params is None:
        return None
    if isinstance(params, list):
        return [p.model_dump(exclude_unset=True) for p in params]
    return params.model_dump(exclude_unset=True)


@router.post(
    "/generate",
    response_model=GenerateResult | list[GenerateResult],
    responses={
        200: {
            "description": "a result, a list of results (batch or n > 1), or with `stream` an "
            "event stream of cumulative results (tagged with `index` for a batch or n > 1; an "
            "error mid-stream is an ErrorResponse event) ending with `data: [DONE]`",
            "content": sse_response_content(GenerateResult, ErrorResponse),
        },
        **_GENERATE_ERRORS,
    },
)
async def generate(body: GenerateRequestIn, request: Request) -> Any:
    """Generate text for a prompt, a batch of prompts, or token ids (SGLang's /generate)."""
    state = get_state(request)
    _check_per_prompt_lists(body)
    try:
        images = await state.tokenizer_manager.prepare_images(body.image_data, "image_data")
    except ValueError as exc:
        raise APIError(400, str(exc), param="image_data") from None
    try:
        reqs, is_batch = prepare_requests(
            state,
            text=body.text,
            input_ids=body.input_ids,
            sampling_params=_sampling_dicts(body.sampling_params),
            return_logprob=False if body.return_logprob is None else body.return_logprob,
            logprob_start_len=body.logprob_start_len,
            top_logprobs_num=body.top_logprobs_num,
            return_text_in_logprobs=bool(body.return_text_in_logprobs),
            rid=body.rid,
            image_data=images,
            bootstrap=bootstrap_of(state, body),
            segments=body.segments,
        )
    except ValueError as exc:
        err = bad_request(exc)
        if isinstance(exc, GrammarError) and exc.kind:  # the message is the parser's
            err.param = f"sampling_params.{exc.kind}"
        elif isinstance(exc, ImageInputError):
            err.param = "image_data"
        elif err.param is None:  # prompt problems: name the field the prompt came in
            err.param = "input_ids" if body.input_ids is not None else "text"
        raise err from None
    tm = state.tokenizer_manager
    single = not is_batch and len(reqs) == 1
    if body.stream:
        tag = (lambda i, chunk: [chunk]) if single else (lambda i, chunk: [{**chunk, "index": i}])
        events = stream_events(state, reqs, tag, lambda: [])
        return StreamingResponse(
            iterate_until_disconnect(request, events),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    results = await run_until_disconnect(request, tm.generate(reqs))
    for result in results:
        raise_if_aborted(state, result)
    body_out = results[0] if single else results
    return Response(to_json(body_out), media_type="application/json")


def _check_per_prompt_lists(body: GenerateRequestIn) -> None:
    """A list-valued per-prompt field must hold one entry per prompt.

    The runtime applies a list of the wrong length to every prompt as a whole, so an empty
    `sampling_params` list would silently mean "defaults" (128 new tokens) instead of an error.
    """
    if isinstance(body.text, list):
        num_prompts = len(body.text)
    elif body.input_ids and isinstance(body.input_ids[0], list):
        num_prompts = len(body.input_ids)
    else:
        num_prompts = 1
    if num_prompts == 0:
        return  # the runtime names the empty batch
    for name in (
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "rid",
    ):
        value = getattr(body, name)
        if isinstance(value, list) and len(value) != num_prompts:
            raise APIError(
                400,
                f"{name}: a list must hold one entry per prompt ({num_prompts}), got {len(value)}",
                param=name,
            )
