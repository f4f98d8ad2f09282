"""The OpenAI-compatible API under /v1: models and completions (chat: `openai_chat.py`).

Requests become the same scheduler requests as native /generate calls (one per prompt and
choice, prompt-major: choice index = prompt * n + j); results are reshaped into OpenAI's objects.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sglite.runtime.server.errors import (
    APIError,
    ErrorResponse,
    error_responses,
)
from sglite.runtime.server.openai_common import (
    GENERATE_ERRORS_CODES,
    check_common,
    finish_reason,
    finite,
    output_constraint,
    prepare,
    sampling_params,
    stream_events,
    stream_response,
    usage_of,
)
from sglite.runtime.server.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from sglite.runtime.server.serving import (
    get_state,
    raise_if_aborted,
)
from sglite.runtime.server.state import ServerState
from sglite.runtime.server.streaming import (
    run_until_disconnect,
    sse_response_content,
)
from sglite.runtime.tokenizer_manager import GenerateRequest

router = APIRouter(prefix="/v1")

_GENERATE_ERRORS = error_responses(*GENERATE_ERRORS_CODES)


# ---------------------------------------------------------------------------- models
def _card(state: ServerState, model_id: str) -> ModelCard:
    return ModelCard(
        id=model_id,
        created=state.created,
        root=state.model_path,
        max_model_len=state.context_length,
    )


@router.get("/models", response_model=ModelList, responses=error_responses(401))
async def list_models(request: Request) -> ModelList:
    """The served model."""
    state = get_state(request)
    return ModelList(data=[_card(state, state.model_name)])


@router.get(
    "/models/{model:path}",
    response_model=ModelCard,
    responses=error_responses(401, 404, descriptions={404: "no such model"}),
)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """One model by id (404 when it is not served here)."""
    state = get_state(request)
    if model != state.model_name and model not in state.model_aliases:
        raise APIError(
            404, f"the model {model!r} does not exist", param="model", code="model_not_found"
        )
    return _card(state, model)


# ---------------------------------------------------------------------------- completions
def _completion_logprobs(
    entries: list[list[Any]], tops: list[Any] | None, offset: int
) -> CompletionLogprobs:
    """Legacy logprobs from `[logprob, id, text]` entries; each top dict holds the chosen token."""
    out = CompletionLogprobs()
    for k, (raw, _tid, text) in enumerate(entries):
        text = text or ""
        logprob = None if raw is None else finite(raw)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        top = tops[k] if tops is not None and k < len(tops) else None
        if top is None and logprob is None:
            out.top_logprobs.append(None)
        else:
            d = {t or "": finite(lp) for lp, _i, t in (top or [])}
            if logprob is not None:
                d.setdefault(text, logprob)
            out.top_logprobs.append(d)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _merge_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={
        200: {
            "description": "a completion, or with `stream` an event stream of completion chunks "
            "(an error mid-stream is an ErrorResponse event) ending with `data: [DONE]`",
            "content": sse_response_content(CompletionResponse, ErrorResponse),
        },
        **_GENERATE_ERRORS,
    },
)
async def completions(body: CompletionRequest, request: Request) -> Any:
    """Complete a prompt (string, list of strings, token ids or list of token-id lists)."""
    state = get_state(request)
    check_common(state, body)
    constraint = output_constraint(body)
    n = body.n or 1
    if body.suffix is not None:
        raise APIError(400, "suffix: not supported", param="suffix", code="not_supported")
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
    prompt = body.prompt
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if isinstance(prompt, str):
        texts = [prompt]
    elif not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    elif isinstance(prompt[0], str):
        texts = prompt  # type: ignore[assignment]
    elif isinstance(prompt[0], int):
        ids = [prompt]  # type: ignore[list-item]
    else:
        ids = prompt  # type: ignore[assignment]
    want_logprobs = body.logprobs is not None
    echo = bool(body.echo)
    base_id = body.rid or f"cmpl-{uuid.uuid4().hex}"
    num_prompts = len(texts if texts is not None else ids or [])
    reqs = prepare(
        state,
        "prompt",
        constraint,
        text=texts,
        input_ids=ids,
        sampling_params=sampling_params(
            body, body.max_tokens if body.max_tokens is not None else 16, constraint
        ),
        return_logprob=want_logprobs,
        logprob_start_len=0 if (echo and want_logprobs) else -1,
        top_logprobs_num=body.logprobs or 0,
        return_text_in_logprobs=True,
        rid=[f"{base_id}-{i}" for i in range(num_prompts)],
    )
    if echo:
        prompt_texts = texts or [state.tokenizer.decode(x, skip_special_tokens=False) for x in ids]
    else:
        prompt_texts = [""] * num_prompts
    model = body.model or state.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _completion_stream(
            state, reqs, n, base_id, model, prompt_texts, echo, want_logprobs, include_usage
        )
        return stream_response(request, events)

    results = await run_until_disconnect(request, state.tokenizer_manager.generate(reqs))
    choices = []
    for k, result in enumerate(results):
        raise_if_aborted(state, result)
        meta = result["meta_info"]
        ptext = prompt_texts[k // n]
        logprobs = None
        if want_logprobs:
            logprobs = _completion_logprobs(
                meta["output_token_logprobs"], meta.get("output_top_logprobs"), len(ptext)
            )
            if echo:
                head = _completion_logprobs(
                    meta["input_token_logprobs"], meta.get("input_top_logprobs"), 0
                )
                logprobs = _merge_logprobs(head, logprobs)
        reason, matched = finish_reason(meta)
        choices.append(
            CompletionChoice(
                index=k,
                text=ptext + result["text"],
                logprobs=logprobs,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    response = CompletionResponse(
        id=base_id, model=model, choices=choices, usage=usage_of(results, n)
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _completion_stream(
    state: ServerState,
    reqs: list[GenerateRequest],
    n: int,
    base_id: str,
    model: str,
    prompt_texts: list[str],
    echo: bool,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    sent = [0] * len(reqs)  # characters of each choice's text already sent
    sent_in = [0] * len(reqs)  # prompt logprob entries already sent (echo)
    started = [False] * len(reqs)
    in_offsets = [0] * len(reqs)
    offsets = [len(prompt_texts[k // n]) for k in range(len(reqs))]
    finals: list[dict[str, Any] | None] = [None] * len(reqs)

    def chunk(k: int, text: str, logprobs: Any, reason: Any, matched: Any) -> dict[str, Any]:
        choice = CompletionChoice(
            index=k, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched
        )
        return CompletionResponse(id=base_id, model=model, choices=[choice]).model_dump(mode="json")

    def on_chunk(k: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        meta = result["meta_info"]
        events = []
        head = ""
        logprobs = None
        if not started[k]:
            started[k] = True
            head = prompt_texts[k // n] if echo else ""
        if echo and want_logprobs:
            # Prompt logprobs may arrive over several increments (chunked prefill).
            entries = meta.get("input_token_logprobs") or []
            tops = meta.get("input_top_logprobs")
            if len(entries) > sent_in[k]:
                start = sent_in[k]
                logprobs = _completion_logprobs(
                    entries[start:], tops[start:] if tops else None, in_offsets[k]
                )
                sent_in[k] = len(entries)
                in_offsets[k] += sum(len(t) for t in logprobs.tokens)
        text = result["text"]
        delta = text[sent[k] :]
        sent[k] = len(text)
        if want_logprobs and meta.get("output_token_logprobs"):
            new = _completion_logprobs(
                meta["output_token_logprobs"], meta.get("output_top_logprobs"), offsets[k]
            )
            offsets[k] += sum(len(t) for t in new.tokens)
            logprobs = new if logprobs is None else _merge_logprobs(logprobs, new)
        reason, matched = finish_reason(meta)
        if reason is not None:
            finals[k] = result
        if head or delta or logprobs is not None or reason is not None:
            events.append(chunk(k, head + delta, logprobs, reason, matched))
        return events

    def on_end() -> list[dict[str, Any]]:
        if not include_usage:
            return []
        done = [r for r in finals if r is not None]
        usage = usage_of(done, n) if len(done) == len(finals) else Usage()
        return [
            CompletionResponse(id=base_id, model=model, choices=[], usage=usage).model_dump(
                mode="json"
            )
        ]

    return stream_events(state, reqs, on_chunk, on_end)


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
