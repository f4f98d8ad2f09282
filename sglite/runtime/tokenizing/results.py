"""Scheduler increments accumulated into SGLang-shaped results.

A request's result is `{"text", "output_ids", "meta_info"}` (`{"embedding", "meta_info"}` for
an embedding request). `RequestResult` holds what the increments have returned so far;
`ResultBuilder` adds an increment to it and shapes the whole result or a stream chunk. A logprob
entry is `[logprob, token_id, text]`, text None unless `return_text_in_logprobs`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sglite.runtime.constrained import CONSTRAINT_KINDS
from sglite.runtime.scheduler.io import RequestOutput
from sglite.runtime.tokenizer import Tokenizer
from sglite.runtime.tokenizing.embeddings import embedding_result
from sglite.runtime.tokenizing.request import GenerateRequest


@dataclass
class RequestResult:
    """What the scheduler has returned for one request so far.

    `text` and `output_ids` are the increments' new text and ids concatenated in order; the
    logprob lists likewise (filled only with `req.return_logprob`, the top ones only with
    `req.top_logprobs_num`); `meta` holds the latest increment's counters. `finished` turns
    True with the first increment carrying a finish reason and never back.
    """

    req: GenerateRequest
    start: float  # time.perf_counter() at submission
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    input_logprobs: list[list[Any]] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    output_logprobs: list[list[Any]] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)
    finished: bool = False
    embedding: list[float] | None = None


@dataclass
class NewLogprobs:
    """The logprob entries one increment added (what a stream chunk carries)."""

    input: list[list[Any]] = field(default_factory=list)
    output: list[list[Any]] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)


class ResultBuilder:
    """Accumulates increments and shapes results; one per TokenizerManager.

    `speculative`: the server runs a speculative algorithm, so results carry its counters.
    """

    def __init__(self, tokenizer: Tokenizer, speculative: bool) -> None:
        self.tokenizer = tokenizer
        self.speculative = speculative

    def add(self, result: RequestResult, out: RequestOutput) -> NewLogprobs:
        """Add increment `out` to `result`; returns the logprob entries it brought."""
        result.text += out.new_text
        result.output_ids.extend(out.new_token_ids)
        result.meta.update(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            cached_tokens_details=out.cached_tokens_details,
            finish_reason=out.finish_reason,
            jump_forward_drafted_tokens=out.jump_forward_drafted,
            jump_forward_accepted_tokens=out.jump_forward_accepted,
            spec_draft_tokens=out.spec_drafted,
            spec_accepted_tokens=out.spec_accepted,
            spec_verify_ct=out.spec_verify_ct,
            segment_tokens=out.segment_tokens,
        )
        req = result.req
        new = NewLogprobs()
        if req.return_logprob:
            new.input = [self._entry(v, t, req) for v, t in out.input_token_logprobs or []]
            new.output = [self._entry(v, t, req) for v, t in out.output_token_logprobs or []]
            if req.top_logprobs_num:
                new.input_top = [self._top(x, req) for x in out.input_top_logprobs or []]
                new.output_top = [self._top(x, req) for x in out.output_top_logprobs or []]
            result.input_logprobs += new.input
            result.output_logprobs += new.output
            result.input_top += new.input_top
            result.output_top += new.output_top
        if out.embedding is not None:
            result.embedding = out.embedding
        if out.finish_reason is not None:
            result.finished = True
        return new

    def chunk(self, result: RequestResult, new: NewLogprobs) -> dict[str, Any]:
        """A stream's chunk after an increment: the cumulative text, the new logprobs only."""
        chunk = self.whole(result)
        if result.req.return_logprob:
            # Only the new tokens' entries, and how many the stream has carried in all (as
            # SGLang 0.5 streams them, so a client can check it got every token).
            chunk["meta_info"]["output_token_logprobs"] = new.output
            chunk["meta_info"]["output_token_logprobs_length"] = len(result.output_logprobs)
            if result.req.top_logprobs_num:
                chunk["meta_info"]["output_top_logprobs"] = new.output_top
        return chunk

    def whole(self, result: RequestResult) -> dict[str, Any]:
        """The result so far (the final result once `result.finished`)."""
        req, got = result.req, result.meta
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": got.get("finish_reason"),
            "prompt_tokens": got.get("prompt_tokens", len(req.input_ids)),
            "completion_tokens": got.get("completion_tokens", 0),
            "cached_tokens": got.get("cached_tokens", 0),
            # Where the cached tokens came from: {"device", "host", "disk"}, summing to the total.
            "cached_tokens_details": got.get("cached_tokens_details")
            or {"device": got.get("cached_tokens", 0), "host": 0, "disk": 0},
            "e2e_latency": time.perf_counter() - result.start,
            # SGLang names the weights a result came from (they change with update_weights).
            "weight_version": "default",
        }
        if any(req.sampling_params.get(k) is not None for k in CONSTRAINT_KINDS):
            meta["jump_forward_drafted_tokens"] = got.get("jump_forward_drafted_tokens", 0)
            meta["jump_forward_accepted_tokens"] = got.get("jump_forward_accepted_tokens", 0)
        if self.speculative:
            for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_ct"):
                meta[key] = got.get(key, 0)
        if req.segments:
            meta["segment_tokens"] = got.get("segment_tokens")
        if req.return_logprob:
            meta["input_token_logprobs"] = result.input_logprobs
            meta["output_token_logprobs"] = result.output_logprobs
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = result.input_top
                meta["output_top_logprobs"] = result.output_top
        if req.pooling is not None:
            return embedding_result(result.embedding, meta)
        return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta}

    def _entry(self, value: float | None, token_id: int, req: GenerateRequest) -> list[Any]:
        text = None
        if req.return_text_in_logprobs:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return [value, token_id, text]

    def _top(self, entries: Any, req: GenerateRequest) -> Any:
        if entries is None:
            return None
        return [self._entry(v, t, req) for v, t in entries]
