"""Text utilities of SGLang's native API that run no model: `/tokenize` and `/detokenize` (also
under `/v1`, as SGLang serves them) and `/parse_function_call` (generated text split into its
plain text and tool calls).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from sglite.http.errors import APIError
from sglite.runtime.server import chat_tools
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.native_protocol import (
    DetokenizeIn,
    DetokenizeOut,
    ParseFunctionCallIn,
    ParseFunctionCallOut,
    TokenizeIn,
    TokenizeOut,
)
from sglite.runtime.server.serving import get_state
from sglite.runtime.server.state import ServerState

router = APIRouter()

# 401 comes from --api-key, 413 from the body size limit.
_BODY_ERRORS = error_responses(400, 401, 413)


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
