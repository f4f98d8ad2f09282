"""The OpenAI-compatible API under /v1: models and completions (chat: `openai_chat.py`).

Requests become the same scheduler requests as native /generate calls (one per prompt and
choice, prompt-major: choice index = prompt * n + j), run by `openai_choices.respond`; this
module gives the completion's side: the echoed prompt, text and legacy logprobs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from sglite.http.errors import APIError, ErrorResponse
from sglite.http.streaming import sse_response_content
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.openai_choices import (
    ChoiceOutput,
    ChoiceRun,
    LogprobEntries,
    respond,
)
from sglite.runtime.server.openai_common import (
    GENERATE_ERRORS_CODES,
    check_common,
    finite,
    output_constraint,
    prepare,
    sampling_params,
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
from sglite.runtime.server.serving import bootstrap_of, get_state
from sglite.runtime.server.state import ServerState

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
def _completion_logprobs(entries: LogprobEntries, offset: int) -> CompletionLogprobs:
    """Legacy logprobs of `entries`, the first token at text offset `offset`; each top dict
    holds the chosen token."""
    out = CompletionLogprobs()
    tops = entries.tops
    for k, (raw, _tid, text) in enumerate(entries.entries):
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


class _CompletionText:
    """One choice's text and legacy logprobs, output by output.

    The first output starts with the echoed prompt (`head`, "" without echo); text offsets count
    from the start of the prompt's logprob tokens and, for the output's, from the end of `head`.
    """

    def __init__(self, head: str) -> None:
        self.head = head
        self.sent = 0  # characters of the choice's text already given
        self.prompt_offset = 0
        self.offset = len(head)

    def advance(self, output: ChoiceOutput) -> tuple[str, CompletionLogprobs | None]:
        """The text and logprobs `output` adds."""
        head, self.head = self.head, ""
        logprobs = None
        if output.prompt_logprobs is not None:
            logprobs = _completion_logprobs(output.prompt_logprobs, self.prompt_offset)
            self.prompt_offset += sum(len(t) for t in logprobs.tokens)
        if output.output_logprobs is not None:
            new = _completion_logprobs(output.output_logprobs, self.offset)
            self.offset += sum(len(t) for t in new.tokens)
            logprobs = new if logprobs is None else _merge_logprobs(logprobs, new)
        delta = output.text[self.sent :]
        self.sent = len(output.text)
        return head + delta, logprobs


class _CompletionStreamer:
    """A streamed completion choice: an event whenever text, logprobs or the finish arrive."""

    def __init__(self, head: str) -> None:
        self.text = _CompletionText(head)

    def opening(self) -> CompletionChoice | None:
        return None

    def increment(self, output: ChoiceOutput) -> CompletionChoice | None:
        text, logprobs = self.text.advance(output)
        if not text and logprobs is None and output.finish_reason is None:
            return None
        return _completion_choice(output, text, logprobs)


def _completion_choice(
    output: ChoiceOutput, text: str, logprobs: CompletionLogprobs | None
) -> CompletionChoice:
    return CompletionChoice(
        index=output.index,
        text=text,
        logprobs=logprobs,
        finish_reason=output.finish_reason,  # type: ignore[arg-type]
        matched_stop=output.matched_stop,
    )


@dataclass(frozen=True)
class _CompletionFormat:
    """Completion choices: text (after the echoed prompt) and legacy logprobs; every chunk is a
    `text_completion` object too."""

    base_id: str
    model: str
    n: int
    heads: list[str]  # per prompt, the echoed prompt text ("" without echo)

    def whole(self, output: ChoiceOutput) -> CompletionChoice:
        text, logprobs = _CompletionText(self.heads[output.index // self.n]).advance(output)
        return _completion_choice(output, text, logprobs)

    def streamer(self, index: int) -> _CompletionStreamer:
        return _CompletionStreamer(self.heads[index // self.n])

    def response(self, choices: list[CompletionChoice], usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.base_id, model=self.model, choices=choices, usage=usage)

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.base_id, model=self.model, choices=choices, usage=usage)


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
        bootstrap=bootstrap_of(state, body),
    )
    if echo:
        heads = texts or [state.tokenizer.decode(x, skip_special_tokens=False) for x in ids or []]
    else:
        heads = [""] * num_prompts
    run = ChoiceRun(
        reqs,
        n,
        _CompletionFormat(base_id, body.model or state.model_name, n, heads),
        output_logprobs=want_logprobs,
        prompt_logprobs=echo and want_logprobs,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
    return await respond(request, state, run)


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
