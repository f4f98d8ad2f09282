"""The native API, compatible with SGLang's server (`sglang.RuntimeEndpoint` speaks it).

Routes: /generate, /health, /health_generate, /get_model_info, /get_server_info, /flush_cache,
/concate_and_append_request, /encode, /tokenize, /detokenize, /metrics. Shapes are in
`docs/server.md` and `native_protocol.py`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import sglite
from sglite.http.errors import APIError, ErrorResponse, error_body
from sglite.http.streaming import (
    SSE_DONE,
    SSE_HEADERS,
    iterate_until_disconnect,
    merge_streams,
    run_until_disconnect,
    sse,
    sse_response_content,
    to_json,
)
from sglite.runtime.constrained.base import GrammarError
from sglite.runtime.multimodal.image_input import ImageInputError
from sglite.runtime.server import chat_tools
from sglite.runtime.server.errors import bad_request, error_responses
from sglite.runtime.server.native_protocol import (
    ConcateAndAppendIn,
    DetokenizeIn,
    DetokenizeOut,
    FlushCacheIn,
    GenerateRequestIn,
    GenerateResult,
    ModelInfo,
    ParseFunctionCallIn,
    ParseFunctionCallOut,
    SamplingParamsIn,
    ServerInfo,
    SuccessOut,
    TokenizeIn,
    TokenizeOut,
)
from sglite.runtime.server.serving import (
    abort_event,
    bootstrap_of,
    get_state,
    prepare_requests,
    raise_if_aborted,
)
from sglite.runtime.server.state import ServerState
from sglite.runtime.tokenizing.request import GenerateRequest

router = APIRouter()

# Statuses each kind of route really answers besides 200 (documented in the OpenAPI schema):
# 401 comes from --api-key on every route but /health, 413 from the body size limit, 503 from
# admission (overload, shutdown, the scheduler gone), 504 from --request-timeout.
_GENERATE_ERRORS = error_responses(400, 401, 413, 503, 504)
_BODY_ERRORS = error_responses(400, 401, 413)


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
        events = _generate_events(state, reqs, tagged=not single)
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


async def _generate_events(
    state: ServerState, reqs: list[GenerateRequest], tagged: bool
) -> AsyncIterator[bytes]:
    tm = state.tokenizer_manager
    try:
        async for i, chunk in merge_streams([tm.stream(r) for r in reqs]):
            error = abort_event(state, chunk)
            if error is not None:
                yield sse(error)
                break
            if tagged:
                chunk["index"] = i
            yield sse(chunk)
    except Exception as exc:  # e.g. the scheduler died between admission and submission
        yield sse(error_body(503 if not state.client.alive else 500, str(exc)))
    yield SSE_DONE


# ---------------------------------------------------------------------------- health and info
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


async def control_or_503(state: ServerState, kind: str, **args: Any) -> Any:
    """A scheduler control request; 503 when the scheduler dies (or hangs) while it runs.

    `check_alive` before the call cannot see a death during it, which would otherwise surface
    as a RuntimeError (a 500, or a 400 from /flush_cache).
    """
    try:
        return await state.control(kind, **args)
    except (TimeoutError, FutureTimeoutError):
        raise APIError(503, f"the model did not answer ({kind}) in time") from None
    except Exception:
        state.check_alive()  # raises the 503 naming why, if the scheduler is gone
        raise


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


# ---------------------------------------------------------------------------- cache control
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


# ---------------------------------------------------------------------------- tool calls
@router.post("/parse_function_call", response_model=ParseFunctionCallOut, responses=_BODY_ERRORS)
async def parse_function_call(body: ParseFunctionCallIn, request: Request) -> ParseFunctionCallOut:
    """Split generated text into its plain text and tool calls (`--tool-call-parser` format
    unless the request names one)."""
    state = get_state(request)
    try:
        text, calls = chat_tools.parse_function_call(
            state, body.text, body.tools, body.tool_call_parser
        )
    except ValueError as exc:
        raise APIError(400, f"tool_call_parser: {exc}", param="tool_call_parser") from None
    index = {t["function"]["name"]: i for i, t in enumerate(body.tools)}
    out = [{"tool_index": index[c.name], "name": c.name, "parameters": c.arguments} for c in calls]
    return ParseFunctionCallOut(normal_text=text, calls=out)


# ---------------------------------------------------------------------------- tokens
def _tokenize(state: ServerState, body: TokenizeIn) -> TokenizeOut:
    prompt = body.prompt if body.prompt is not None else body.text
    if prompt is None:
        raise APIError(400, "prompt: give the text to tokenize (prompt or text)", param="prompt")
    state.check_model(body.model)
    tok = state.tokenizer
    if isinstance(prompt, str):
        ids: Any = tok.encode(prompt, add_special_tokens=body.add_special_tokens)
        count: Any = len(ids)
    else:
        ids = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in prompt]
        count = [len(x) for x in ids]
    return TokenizeOut(tokens=ids, count=count, max_model_len=state.context_length)


@router.post(
    "/tokenize",
    response_model=TokenizeOut,
    response_model_exclude_none=True,
    responses=_BODY_ERRORS,
)
async def tokenize(body: TokenizeIn, request: Request) -> TokenizeOut:
    """Token ids of a text (or of each text in a list)."""
    return _tokenize(get_state(request), body)


@router.post(
    "/v1/tokenize",
    response_model=TokenizeOut,
    response_model_exclude_none=True,
    responses=_BODY_ERRORS,
)
async def tokenize_v1(body: TokenizeIn, request: Request) -> TokenizeOut:
    """Token ids of a text (OpenAI-style path, as SGLang serves it)."""
    return _tokenize(get_state(request), body)


def _detokenize(state: ServerState, body: DetokenizeIn) -> DetokenizeOut:
    state.check_model(body.model)
    vocab = state.client.info["vocab_size"]
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    lists: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment,list-item]
    for ids in lists:
        for t in ids:
            if not 0 <= t < vocab:
                raise APIError(
                    400, f"tokens: {t} is outside the vocabulary [0, {vocab})", param="tokens"
                )
    texts = [
        state.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists
    ]
    return DetokenizeOut(text=texts if batch else texts[0])


@router.post("/detokenize", response_model=DetokenizeOut, responses=_BODY_ERRORS)
async def detokenize(body: DetokenizeIn, request: Request) -> DetokenizeOut:
    """The text of a list of token ids (or of each list in a list)."""
    return _detokenize(get_state(request), body)


@router.post("/v1/detokenize", response_model=DetokenizeOut, responses=_BODY_ERRORS)
async def detokenize_v1(body: DetokenizeIn, request: Request) -> DetokenizeOut:
    """The text of token ids (OpenAI-style path, as SGLang serves it)."""
    return _detokenize(get_state(request), body)


# ---------------------------------------------------------------------------- metrics
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


# SGLang also serves these with other methods; registered apart so the OpenAPI schema keeps one
# operation (and one operation id) per route.
for _path, _endpoint, _method in (
    ("/generate", generate, "PUT"),
    ("/flush_cache", flush_cache, "GET"),
    ("/concate_and_append_request", concate_and_append_request, "GET"),
):
    router.add_api_route(_path, _endpoint, methods=[_method], include_in_schema=False)


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
