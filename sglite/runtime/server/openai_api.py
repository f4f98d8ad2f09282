"""The OpenAI-compatible API under /v1: models, completions and chat completions.

Requests become the same scheduler requests as native /generate calls (one per prompt and
choice, prompt-major: choice index = prompt * n + j); results are reshaped into OpenAI's objects.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from sglite.runtime.server.errors import (
    APIError,
    ErrorResponse,
    bad_request,
    error_body,
    error_responses,
)
from sglite.runtime.server.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseFormat,
    TokenLogprob,
    TopLogprob,
    Usage,
    _SamplingExtras,
)
from sglite.runtime.server.serving import (
    abort_event,
    constraint_of,
    get_state,
    prepare_requests,
    raise_if_aborted,
)
from sglite.runtime.server.state import ServerState
from sglite.runtime.server.streaming import (
    SSE_DONE,
    SSE_HEADERS,
    iterate_until_disconnect,
    merge_streams,
    run_until_disconnect,
    sse,
    sse_response_content,
)
from sglite.runtime.tokenizer_manager import GenerateRequest

router = APIRouter(prefix="/v1")

# Statuses the generating routes really answer besides 200 (401 with --api-key, 413 from the body
# size limit, 503 from admission, 504 from --request-timeout).
_GENERATE_ERRORS = error_responses(400, 401, 413, 503, 504)
# Runtime field names in validation messages -> the names OpenAI clients sent.
_RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


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


# ---------------------------------------------------------------------------- shared
def _check_common(state: ServerState, body: _SamplingExtras) -> None:
    state.check_model(body.model)
    if body.logit_bias:
        raise APIError(
            400, "logit_bias: not supported yet", param="logit_bias", code="not_supported"
        )


@dataclass(frozen=True)
class _Constraint:
    """The request's output constraint: runtime `kind` and text, and the field it came from."""

    kind: str  # regex, ebnf or json_schema (the runtime's sampling parameter)
    text: str
    field: str  # what the client set: regex, ebnf, json_schema or response_format...


def _constraint(body: _SamplingExtras) -> _Constraint | None:
    """The one constraint of a request (SGLang's extras or `response_format`), else None.

    Two at once answer 400 naming both: the runtime enforces one grammar per request.
    """
    found: list[_Constraint] = []
    for key in ("regex", "ebnf", "json_schema"):
        value = getattr(body, key)
        if value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            found.append(_Constraint(key, text, key))
    if body.response_format is not None:
        schema = _response_format_schema(body.response_format)
        if schema is not None:
            found.append(_Constraint("json_schema", schema[0], schema[1]))
    if len(found) > 1:
        names = [c.field.split(".")[0] for c in found]
        raise APIError(
            400,
            f"{names[1]}: cannot be combined with {names[0]}; a request takes at most one "
            "constraint (regex, ebnf, json_schema or a JSON response_format)",
            param=names[1],
        )
    return found[0] if found else None


def _response_format_schema(fmt: ResponseFormat) -> tuple[str, str] | None:
    """(JSON schema text, field it came from) for a JSON `response_format`; None for `text`."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"}), "response_format"
    spec = fmt.json_schema
    if spec is None:
        raise APIError(
            400,
            "response_format.json_schema: required when type is json_schema "
            '(e.g. {"name": "answer", "schema": {...}, "strict": true})',
            param="response_format.json_schema",
        )
    field = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if schema is None:
        raise APIError(400, f"{field}: missing; give the JSON schema of the output", param=field)
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"{field}: must be a JSON schema object", param=field)
    return json.dumps(schema), field


def _sampling(
    body: _SamplingExtras, max_new_tokens: int | None, constraint: _Constraint | None
) -> dict[str, Any]:
    params = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": body.min_tokens,
        "n": body.n,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "no_stop_trim": body.no_stop_trim,
        "seed": body.seed,
    }
    if constraint is not None:
        params[constraint.kind] = constraint.text
    return {k: v for k, v in params.items() if v is not None}


def _prepare(
    state: ServerState, default_param: str, constraint: _Constraint | None, **kwargs: Any
) -> list[GenerateRequest]:
    try:
        reqs, _ = prepare_requests(state, **kwargs)
    except ValueError as exc:
        err = bad_request(exc, _RENAME)
        if constraint is not None and constraint_of(err.message) == constraint.kind:
            # An invalid grammar: keep the parser's message, name the field the client set.
            err.param = constraint.field
            if constraint.field != constraint.kind:
                err.message = f"{constraint.field}: {err.message}"
        elif err.param is None:
            err.param = default_param
        raise err from None
    return reqs


def _finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    kind = "length" if reason.get("type") == "length" else "stop"
    return kind, reason.get("matched")


def _usage(results: list[dict[str, Any]], n: int) -> Usage:
    # The prompt counts once per prompt (as OpenAI does); its first choice reports the cache hit.
    firsts = [r["meta_info"] for r in results[::n]]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    cached = sum(m["cached_tokens"] for m in firsts)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _stream_response(request: Request, events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        iterate_until_disconnect(request, events),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _stream_events(
    state: ServerState,
    reqs: list[GenerateRequest],
    on_chunk: Any,
    on_end: Any,
) -> AsyncIterator[bytes]:
    """Run `reqs` as streams; `on_chunk(index, chunk)` and `on_end()` return events to send."""
    tm = state.tokenizer_manager
    try:
        async for i, chunk in merge_streams([tm.stream(r) for r in reqs]):
            error = abort_event(state, chunk)
            if error is not None:
                yield sse(error)
                break
            for event in on_chunk(i, chunk):
                yield sse(event)
        else:
            for event in on_end():
                yield sse(event)
    except Exception as exc:
        yield sse(error_body(503 if not state.client.alive else 500, str(exc)))
    yield SSE_DONE


def _finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token the sampling parameters ruled out) and NaN become
    -9999.0, as the native API writes them; pydantic would write `null`, which the schema and
    OpenAI clients do not allow."""
    return logprob if math.isfinite(logprob) else -9999.0


# ---------------------------------------------------------------------------- completions
def _completion_logprobs(
    entries: list[list[Any]], tops: list[Any] | None, offset: int
) -> CompletionLogprobs:
    """Legacy logprobs from `[logprob, id, text]` entries; each top dict holds the chosen token."""
    out = CompletionLogprobs()
    for k, (raw, _tid, text) in enumerate(entries):
        text = text or ""
        logprob = None if raw is None else _finite(raw)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        top = tops[k] if tops is not None and k < len(tops) else None
        if top is None and logprob is None:
            out.top_logprobs.append(None)
        else:
            d = {t or "": _finite(lp) for lp, _i, t in (top or [])}
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
    _check_common(state, body)
    constraint = _constraint(body)
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
    reqs = _prepare(
        state,
        "prompt",
        constraint,
        text=texts,
        input_ids=ids,
        sampling_params=_sampling(
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
        return _stream_response(request, events)

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
        reason, matched = _finish(meta)
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
        id=base_id, model=model, choices=choices, usage=_usage(results, n)
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
        reason, matched = _finish(meta)
        if reason is not None:
            finals[k] = result
        if head or delta or logprobs is not None or reason is not None:
            events.append(chunk(k, head + delta, logprobs, reason, matched))
        return events

    def on_end() -> list[dict[str, Any]]:
        if not include_usage:
            return []
        done = [r for r in finals if r is not None]
        usage = _usage(done, n) if len(done) == len(finals) else Usage()
        return [
            CompletionResponse(id=base_id, model=model, choices=[], usage=usage).model_dump(
                mode="json"
            )
        ]

    return _stream_events(state, reqs, on_chunk, on_end)


# ---------------------------------------------------------------------------- chat
def _render_messages(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, msg in enumerate(body.messages):
        content: Any = msg.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages.{i}.content.{j}: only text content parts are supported "
                        f"(got type {part.type!r})",
                        param=f"messages.{i}.content",
                        code="not_supported",
                    )
                parts.append(part.text)
            content = "".join(parts)
        entry: dict[str, Any] = {"role": msg.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(msg, key)
            if value is not None:
                entry[key] = value
        messages.append(entry)
    continue_final = bool(body.continue_final_message)
    if continue_final and messages[-1]["role"] != "assistant":
        raise APIError(
            400,
            "continue_final_message: the last message must be from the assistant",
            param="continue_final_message",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    if continue_final:
        kwargs["continue_final_message"] = True
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=not continue_final, tools=body.tools, **kwargs
        )
    except Exception as exc:  # template errors (e.g. roles must alternate) are the client's
        raise APIError(
            400, f"messages: the chat template rejected them: {exc}", "messages"
        ) from None
    ids = state.tokenizer.encode(text)
    bos = state.tokenizer.bos_token_id
    # Templates that write the BOS text themselves get a second BOS from the tokenizer.
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def _chat_logprobs(
    entries: list[list[Any]], tops: list[Any] | None, num_top: int
) -> ChoiceLogprobs:
    content = []
    for k, (logprob, _tid, text) in enumerate(entries):
        text = text or ""
        top = tops[k] if tops is not None and k < len(tops) and tops[k] else []
        content.append(
            TokenLogprob(
                token=text,
                logprob=_finite(logprob),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=t or "", logprob=_finite(lp), bytes=list((t or "").encode()))
                    for lp, _i, t in top[:num_top]
                ],
            )
        )
    return ChoiceLogprobs(content=content)


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={
        200: {
            "description": "a chat completion, or with `stream` an event stream of "
            "chat.completion.chunk objects (an error mid-stream is an ErrorResponse event) "
            "ending with `data: [DONE]`",
            "content": sse_response_content(ChatCompletionChunk, ErrorResponse),
        },
        **_GENERATE_ERRORS,
    },
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """Answer a conversation, rendered through the model's chat template."""
    state = get_state(request)
    _check_common(state, body)
    constraint = _constraint(body)
    if body.tool_choice not in (None, "none", "auto"):
        raise APIError(
            400,
            "tool_choice: forcing a tool call is not supported yet",
            param="tool_choice",
            code="not_supported",
        )
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
    n = body.n or 1
    ids = _render_messages(state, body)
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens is None:  # the rest of the context (or of the KV pool, if smaller)
        tm = state.tokenizer_manager
        max_tokens = max(0, min(tm.context_len, tm.max_total_tokens) - len(ids))
        if state.args.max_new_tokens_limit is not None:
            max_tokens = min(max_tokens, state.args.max_new_tokens_limit)
    want_logprobs = bool(body.logprobs)
    num_top = body.top_logprobs or 0
    base_id = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    reqs = _prepare(
        state,
        "messages",
        constraint,
        text=None,
        input_ids=ids,
        sampling_params=_sampling(body, max_tokens, constraint),
        return_logprob=want_logprobs,
        logprob_start_len=-1,
        top_logprobs_num=num_top,
        return_text_in_logprobs=True,
        rid=base_id,
    )
    model = body.model or state.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _chat_stream(state, reqs, n, base_id, model, want_logprobs, num_top, include_usage)
        return _stream_response(request, events)

    results = await run_until_disconnect(request, state.tokenizer_manager.generate(reqs))
    choices = []
    for k, result in enumerate(results):
        raise_if_aborted(state, result)
        meta = result["meta_info"]
        logprobs = None
        if want_logprobs:
            logprobs = _chat_logprobs(
                meta["output_token_logprobs"], meta.get("output_top_logprobs"), num_top
            )
        reason, matched = _finish(meta)
        choices.append(
            ChatChoice(
                index=k,
                message=AssistantMessage(content=result["text"]),
                logprobs=logprobs,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    response = ChatCompletionResponse(
        id=base_id, model=model, choices=choices, usage=_usage(results, n)
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _chat_stream(
    state: ServerState,
    reqs: list[GenerateRequest],
    n: int,
    base_id: str,
    model: str,
    want_logprobs: bool,
    num_top: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    sent = [0] * len(reqs)
    started = [False] * len(reqs)
    finals: list[dict[str, Any] | None] = [None] * len(reqs)

    def chunk(k: int, delta: DeltaMessage, logprobs: Any, reason: Any, matched: Any) -> dict:
        choice = ChatStreamChoice(
            index=k, delta=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
        )
        return ChatCompletionChunk(id=base_id, model=model, choices=[choice]).model_dump(
            mode="json"
        )

    def on_chunk(k: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        meta = result["meta_info"]
        events = []
        if not started[k]:
            started[k] = True
            events.append(chunk(k, DeltaMessage(role="assistant", content=""), None, None, None))
        text = result["text"]
        delta = text[sent[k] :]
        sent[k] = len(text)
        logprobs = None
        if want_logprobs and meta.get("output_token_logprobs"):
            logprobs = _chat_logprobs(
                meta["output_token_logprobs"], meta.get("output_top_logprobs"), num_top
            )
        reason, matched = _finish(meta)
        if reason is not None:
            finals[k] = result
        if delta or logprobs is not None or reason is not None:
            events.append(chunk(k, DeltaMessage(content=delta or None), logprobs, reason, matched))
        return events

    def on_end() -> list[dict[str, Any]]:
        if not include_usage:
            return []
        done = [r for r in finals if r is not None]
        usage = _usage(done, n) if len(done) == len(finals) else Usage()
        return [
            ChatCompletionChunk(id=base_id, model=model, choices=[], usage=usage).model_dump(
                mode="json"
            )
        ]

    return _stream_events(state, reqs, on_chunk, on_end)


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
