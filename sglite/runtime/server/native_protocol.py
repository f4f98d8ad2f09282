"""Request and response bodies of the native (SGLang-compatible) API.

Field names and shapes follow SGLang's `GenerateReqInput` and sampling parameters so that
`sglang.RuntimeEndpoint` works unchanged. Every field accepts `null` as "unset" because that client
sends defaults literally. Range checks that need the model (context length, vocabulary) happen in
the TokenizerManager; the constraints here are the static ones, so the OpenAPI schema states them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sglite.runtime.sampling.params import MIN_REPETITION_PENALTY
from sglite.runtime.server.types import Bool, Float, Int, Text

# Upper bound on `n` (parallel samples per prompt); each sample is a full request in the scheduler.
MAX_N = 64


class SamplingParamsIn(BaseModel):
    """`sampling_params` of a /generate request (SGLang's names; null = default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: Int | None = Field(None, ge=0, description="0 = prefill only (fills the cache)")
    min_new_tokens: Int | None = Field(None, ge=0)
    n: Int | None = Field(None, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    stop_token_ids: Int | list[Int] | None = None
    stop_regex: Text | list[Text] | None = None
    temperature: Float | None = Field(None, ge=0, description="0 = greedy")
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, description="-1 (or 0) = off")
    min_p: Float | None = Field(None, ge=0, le=1)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=2)
    ignore_eos: Bool | None = None
    skip_special_tokens: Bool | None = None
    spaces_between_special_tokens: Bool | None = None
    no_stop_trim: Bool | None = None
    regex: str | None = Field(None, description="constrain the output to match this regex")
    json_schema: str | dict[str, Any] | None = Field(
        None, description="constrain the output to JSON valid under this schema (string or object)"
    )
    ebnf: str | None = Field(
        None, description="constrain the output to this grammar (GBNF `root ::= ...`, or Lark)"
    )
    seed: Int | None = None
    close_structure_on_length: Bool | None = Field(
        None,
        description=(
            "when max_new_tokens nearly runs out, a constrained output closes its structure "
            "(strings, arrays, objects) so that it still parses"
        ),
    )


class GenerateRequestIn(BaseModel):
    """POST /generate: one prompt, a batch of prompts, or token ids (exactly one of them)."""

    model_config = ConfigDict(extra="ignore")

    text: Text | list[Text] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: Bool | list[Bool] | None = None
    logprob_start_len: Int | list[Int] | None = Field(
        None, description="first prompt position with logprobs; -1 = output only"
    )
    top_logprobs_num: Int | list[Int] | None = None
    return_text_in_logprobs: Bool | None = None
    stream: Bool | None = None
    rid: str | list[str] | None = None
    segments: list[list[Int]] | list[list[list[Int]]] | None = Field(
        None,
        description="reusable spans [start, end) of the prompt (characters of `text`, tokens of "
        "`input_ids`; a list per prompt for a batch): their KV is cached by content and reused "
        "wherever they appear",
    )
    bootstrap_host: str | None = Field(None, description="disaggregated serving: prefill host")
    bootstrap_port: Int | None = Field(None, description="the prefill server's bootstrap port")
    bootstrap_room: Int | str | None = Field(None, description="pairs prefill and decode")
    image_data: Any = Field(
        None,
        description="vision-language models: an image (data: URL, file path or base64; http(s) "
        "URLs with --allow-remote-images) or a list of them; a list per prompt for a batch. The "
        "prompt's image tokens mark where they go (else they go first)",
    )


class MetaInfo(BaseModel):
    """`meta_info` of a result; logprob lists appear only with `return_logprob`."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    input_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[Any] | None = None
    output_top_logprobs: list[Any] | None = None


class GenerateResult(BaseModel):
    """One result of /generate (a batch answers with a list of these)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = Field(None, description="position in the batch (streamed batches only)")


class TokenizeIn(BaseModel):
    """POST /tokenize (and /encode): text to token ids."""

    model_config = ConfigDict(extra="ignore")

    prompt: Text | list[Text] | None = None
    text: Text | list[Text] | None = Field(None, description="alias of prompt")
    model: str | None = None
    add_special_tokens: Bool = True


class TokenizeOut(BaseModel):
    """Token ids of each prompt, their counts and the context length."""

    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeIn(BaseModel):
    """POST /detokenize: token ids to text."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[Int] | list[list[Int]]
    model: str | None = None
    skip_special_tokens: Bool = True


class DetokenizeOut(BaseModel):
    """The text of each id list."""

    text: str | list[str]


class ConcateAndAppendIn(BaseModel):
    """POST /concate_and_append_request (SGLang's `join(mode="concate_and_append")`)."""

    model_config = ConfigDict(extra="ignore")

    src_rids: list[str]
    dst_rid: str


class FlushCacheIn(BaseModel):
    """Optional body of POST /flush_cache (SGLang's client sends `{"empty_cache": true}`)."""

    model_config = ConfigDict(extra="ignore")

    empty_cache: Bool | None = None


class ModelInfo(BaseModel):
    """GET /get_model_info: SGLang's client picks its chat template from `model_path`."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    served_model_name: str
    context_length: int
    vocab_size: int
    architecture: str | None = None
    dtype: str | None = None
    device: str | None = None
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str = "default"


class SuccessOut(BaseModel):
    """A plain acknowledgement."""

    success: bool = True
    message: str = ""


class KVInvariants(BaseModel):
    """The scheduler's KV slot accounting check (`ok` false with `error` when it fails)."""

    model_config = ConfigDict(extra="allow")

    ok: bool
    free: int | None = Field(None, description="free slots")
    cached: int | None = Field(None, description="slots owned by the radix cache")
    held_by_requests: int | None = Field(None, description="slots owned by running requests")
    error: str | None = None


class ServerInfo(BaseModel):
    """GET /get_server_info: every server argument (not the API key), model facts, live
    statistics from the scheduler and the KV accounting check; the fields below always appear."""

    model_config = ConfigDict(extra="allow")

    model_path: str | None
    served_model_name: str
    context_length: int
    max_total_num_tokens: int
    num_running_reqs: int
    num_queued_reqs: int
    num_in_flight_reqs: int
    num_free_slots: int
    cache_size_tokens: int
    cache_hit_rate: float
    kv_invariants: KVInvariants
    internal_states: list[dict[str, Any]]
    version: str


class ParseFunctionCallIn(BaseModel):
    """POST /parse_function_call: tool calls out of text generated with `/generate`."""

    text: Text
    tools: list[dict[str, Any]] = Field(min_length=1)
    tool_call_parser: str | None = None


class ParseFunctionCallOut(BaseModel):
    """The text around the calls, and each call (`parameters` as JSON text), as SGLang answers."""

    normal_text: str
    calls: list[dict[str, Any]]
