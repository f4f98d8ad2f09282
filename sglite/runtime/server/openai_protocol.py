"""Request and response bodies of the OpenAI-compatible API (`/v1`).

Shapes follow OpenAI's API reference plus the extra sampling fields SGLang and vLLM accept
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, ...) and SGLang's constraints (`regex`,
`ebnf`, `json_schema`, also `response_format` on completions). Unknown request fields are
ignored, as OpenAI's newer clients send fields (`store`, `metadata`, ...) older servers lack.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer
from typing_extensions import TypedDict

from sglite.runtime.sampling.params import MIN_REPETITION_PENALTY
from sglite.runtime.server.native_protocol import MAX_N
from sglite.runtime.server.types import Bool, Float, Int, Text

# OpenAI caps completions' `logprobs` at 5; vLLM and SGLang allow up to 20, as the runtime does.
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a final chunk with the usage and no choices."""

    model_config = ConfigDict(extra="ignore")

    include_usage: Bool | None = False


class ResponseFormat(BaseModel):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (`{"name", "schema", "strict"}`: JSON valid under `schema`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(
        None, description='with type json_schema: {"name": ..., "schema": {...}, "strict": ...}'
    )


class _SamplingExtras(BaseModel):
    """Sampling fields shared by completions and chat (OpenAI's plus SGLang/vLLM extras)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, description="a served model id (see GET /v1/models)")
    temperature: Float | None = Field(None, ge=0, description="0 = greedy")
    top_p: Float | None = Field(None, gt=0, le=1)
    n: Int | None = Field(None, ge=1, le=MAX_N)
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Float] | None = Field(None, description="not supported; must be empty")
    seed: Int | None = None
    user: str | None = None
    # SGLang / vLLM extras
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=2)
    min_tokens: Int | None = Field(None, ge=0)
    ignore_eos: Bool | None = None
    skip_special_tokens: Bool | None = None
    spaces_between_special_tokens: Bool | None = None
    no_stop_trim: Bool | None = None
    stop_token_ids: list[Int] | None = None
    regex: str | None = Field(None, description="constrain the output to match this regex")
    ebnf: str | None = Field(
        None, description="constrain the output to this grammar (GBNF `root ::= ...`, or Lark)"
    )
    json_schema: str | dict[str, Any] | None = Field(
        None, description="constrain the output to JSON valid under this schema"
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object / json_schema constrain the output to JSON"
    )
    close_structure_on_length: Bool | None = Field(
        None,
        description=(
            "when max_tokens nearly runs out, a constrained answer (JSON, tool call) closes its "
            "structure so that it still parses (finish_reason stays length)"
        ),
    )
    rid: str | None = Field(None, description="request id (SGLang extra)")
    # Disaggregated serving (SGLang extras; the PD router sets them): docs/pd.md.
    bootstrap_host: str | None = None
    bootstrap_port: Int | None = None
    bootstrap_room: Int | str | None = None


class CompletionRequest(_SamplingExtras):
    """POST /v1/completions."""

    prompt: Text | list[Text] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Bool | None = False
    suffix: str | None = Field(None, description="not supported")
    best_of: Int | None = Field(None, ge=1, description="only best_of == n is supported")


class ContentPart(BaseModel):
    """One part of a message's content: `{"type": "text", "text": ...}`, or for vision-language
    models `{"type": "image_url", "image_url": {"url": ...}}` (a data: URL or a file path; http(s)
    URLs with --allow-remote-images)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingExtras):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=0, description="default: the rest of the context")
    max_completion_tokens: Int | None = Field(None, ge=0, description="alias of max_tokens")
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(
        None, description="functions the model may call; calls come back in message.tool_calls"
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='none, auto (the default with tools), required, or {"type": "function", '
        '"function": {"name": ...}}; required and named calls are enforced by the grammar',
    )
    parallel_tool_calls: Bool | None = None
    continue_final_message: Bool | None = Field(
        False, description="continue the last (assistant) message instead of starting a new one"
    )
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: Bool | None = Field(
        True,
        description="with --reasoning-parser: reasoning in reasoning_content (else kept "
        "in content)",
    )


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    """How many prompt tokens came from the radix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a request (prompt counted once per prompt, completions summed)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs (parallel lists, one entry per token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    matched_stop: int | str | None = Field(None, description="the stop string or token that hit")


class CompletionResponse(BaseModel):
    """The answer of POST /v1/completions (also each streamed chunk, with partial text)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    """The chosen token at a position, its logprob and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """Chat logprobs of a choice."""

    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    """One chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """The answer of POST /v1/chat/completions."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class _DeltaJSON(TypedDict, total=False):
    """What a DeltaMessage serializes to (its schema in the OpenAPI document)."""

    role: Literal["assistant"]
    content: str
    reasoning_content: str
    tool_calls: list[dict[str, Any]]


class DeltaMessage(BaseModel):
    """The new part of a streamed message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> _DeltaJSON:
        return {k: v for k, v in handler(self).items() if v is not None}  # type: ignore[return-value]


class ChatStreamChoice(BaseModel):
    """One choice's increment in a streamed chat completion."""

    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sglite"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
