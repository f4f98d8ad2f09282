"""Messages between the client side (Engine / HTTP server) and the scheduler process.

They travel pickled over ZeroMQ. The client tokenizes and sends `GenerateInput`; the scheduler
answers with `BatchOutput`s, one per forward step, each carrying the increments of every request
that advanced in that step (for a request with `stream=False`: only its first and its final
increment, which then holds everything in between). Control requests (`ControlInput`) are
answered by `ControlOutput` with the same `token`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from sglite.runtime.disaggregation.messages import Bootstrap


class AbortKind(enum.Enum):
    """Why a request ended with an abort, carrying the HTTP status the server answers it with
    (SGLang's abort finish reason carries `status_code` and `err_type` the same way)."""

    REJECTED = (400, "invalid_request_error")  # it cannot be served as asked (too long, ...)
    CANCELLED = (400, "cancelled")  # its client aborted it or went away
    INTERNAL = (500, "internal_error")  # the runtime failed while serving it
    UPSTREAM = (502, "upstream_error")  # disaggregated: the other server or the link failed
    UNAVAILABLE = (503, "unavailable")  # the server is shutting down or lost its scheduler
    TIMEOUT = (504, "timeout")  # it ran past --request-timeout

    @property
    def status_code(self) -> int:
        return self.value[0]

    @property
    def err_type(self) -> str:
        return self.value[1]


# A request's end as clients see it in `meta_info.finish_reason` (SGLang's shape):
# {"type": "stop", "matched": ...}, {"type": "length", "length": n}, or an abort (`abort_reason`).
FinishReason = dict[str, Any]


def abort_reason(message: str, kind: AbortKind) -> FinishReason:
    """The finish reason of a request ended by `kind` of abort, `message` saying why."""
    return {
        "type": "abort",
        "message": message,
        "status_code": kind.status_code,
        "err_type": kind.err_type,
    }


def abort_status(reason: FinishReason) -> int:
    """The HTTP status of an abort finish reason (400 for one without a status)."""
    return int(reason.get("status_code") or 400)


@dataclass
class GenerateInput:
    """One generation request, already tokenized and validated on the client side."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1 = output logprobs only
    top_logprobs_num: int = 0
    arrival_time: float = 0.0
    # False: the client wants only the whole answer, so the scheduler sends the first increment
    # (time to first token) and the last, not one message per step.
    stream: bool = True
    # An embedding request: the prompt's hidden states pooled ("last" token or "mean"), no
    # output tokens.
    pooling: str | None = None
    # Images in the prompt (`multimodal.processor.ImageItem`), in prompt order.
    images: list[Any] = field(default_factory=list)
    # Disaggregated serving: where this request's prefill runs and its room (docs/pd.md).
    bootstrap: Bootstrap | None = None
    # Reusable segments: token spans [start, end) of the prompt whose KV is cached by content
    # and reused wherever they appear (scheduler/segments.py); empty = exact prefill.
    segments: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class AbortInput:
    """Stop a request (client disconnected or cancelled); its KV slots are freed."""

    rid: str
    message: str = "aborted by the client"
    kind: AbortKind = AbortKind.CANCELLED


@dataclass
class ControlInput:
    """A request for the scheduler itself: flush_cache, get_info, check_invariants, shutdown."""

    kind: str
    token: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlOutput:
    """The answer to a ControlInput with the same token."""

    token: int
    ok: bool
    value: Any = None
    error: str | None = None


@dataclass
class RequestOutput:
    """What one request gained in one step. Logprob lists hold only the new entries."""

    rid: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # cached_tokens split by tier: {"device": .., "host": .., "disk": ..} (sums to cached_tokens)
    cached_tokens_details: dict[str, int] | None = None
    completion_tokens: int = 0
    jump_forward_drafted: int = 0  # cumulative forced tokens drafted / accepted
    jump_forward_accepted: int = 0
    spec_drafted: int = 0  # cumulative speculative draft tokens / accepted / verify passes
    spec_accepted: int = 0
    spec_verify_ct: int = 0
    # [(logprob | None, token_id)] entries; text is attached on the client side when asked.
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Segmented prompts: {"reused", "recomputed", "computed"} prompt tokens (None without).
    segment_tokens: dict[str, int] | None = None
    # An embedding request's L2-normalized pooled hidden state (final increment only).
    embedding: list[float] | None = None


@dataclass
class BatchOutput:
    """All request increments produced by one scheduler step."""

    outputs: list[RequestOutput]


# The key of `ReadyMessage.info` holding the served model's stop token ids and chat template
# (`{"eos_token_ids": [...], "chat_template": str | None}`), which the client takes out.
SERVED_TOKENS = "served_tokens"


@dataclass
class ReadyMessage:
    """Sent once by the scheduler process when the model is loaded (or loading failed)."""

    ok: bool
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def check_segments(segments: list[tuple[int, int]], num_prompt: int) -> str | None:
    """Why token spans cannot be a request's segments (sorted, disjoint, non-empty, inside the
    prompt), or None."""
    previous_end = 0
    for i, span in enumerate(segments):
        if len(span) != 2 or not all(isinstance(x, int) for x in span):
            return f"segments[{i}] must be [start, end]"
        start, end = span
        if not 0 <= start < end <= num_prompt:
            return (
                f"segments[{i}] = [{start}, {end}] is not a non-empty span of the "
                f"{num_prompt}-token prompt"
            )
        if start < previous_end:
            return f"segments[{i}] overlaps or precedes the one before it"
        previous_end = end
    return None
