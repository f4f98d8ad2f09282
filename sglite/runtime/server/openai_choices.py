"""Running the choices of an OpenAI completion or chat completion, whole or streamed.

Both routes admit one scheduler request per prompt and choice (prompt-major: choice index =
prompt * n + j) and answer one object per choice plus usage. `respond` owns what they share:
running the requests, aborts, finish reasons, the logprob entries each output brings, usage and
the event-stream framing. The route passes a `ChoiceFormat`: how one choice's output reads
(completion text, or a chat message with reasoning and tool calls) and the envelopes around
choices (a response, a chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from sglite.http.streaming import (
    SSE_HEADERS,
    iterate_until_disconnect,
    run_until_disconnect,
)
from sglite.runtime.server.openai_protocol import PromptTokensDetails, Usage
from sglite.runtime.server.serving import raise_if_aborted, stream_events
from sglite.runtime.server.state import ServerState
from sglite.runtime.tokenizing.request import GenerateRequest

JSON = dict[str, Any]
WholeT = TypeVar("WholeT", bound=BaseModel)
StreamT = TypeVar("StreamT", bound=BaseModel)
StreamT_co = TypeVar("StreamT_co", bound=BaseModel, covariant=True)


@dataclass(frozen=True)
class LogprobEntries:
    """Logprobs of consecutive tokens as the runtime reports them."""

    entries: list[list[Any]]  # per token [logprob, token id, token text]
    tops: list[Any] | None  # per token its most likely alternatives, same shape (or None)


@dataclass(frozen=True)
class ChoiceOutput:
    """One choice's output as of one result.

    Invariants: `text` is the whole text so far (a later output of the same choice extends it).
    The logprob fields hold only entries no earlier output of the choice held (all of them for
    a whole answer); they are None when the request did not ask for them and, streamed, when an
    output brings none. `finish_reason` ("stop" or "length") is set on a choice's last output.
    """

    index: int
    text: str
    prompt_logprobs: LogprobEntries | None
    output_logprobs: LogprobEntries | None
    finish_reason: str | None
    matched_stop: Any


class ChoiceStreamer(Protocol[StreamT_co]):
    """The route's formatting of one streamed choice; it may keep state between outputs."""

    def opening(self) -> StreamT_co | None:
        """What to send before the choice's first output (None: nothing)."""
        ...

    def increment(self, output: ChoiceOutput) -> StreamT_co | None:
        """The choice object of one output; None when it carries nothing to send."""
        ...


class ChoiceFormat(Protocol[WholeT, StreamT]):
    """The route's part of an answer: choice objects and the envelopes around them."""

    def whole(self, output: ChoiceOutput) -> WholeT:
        """The choice object of a finished, non-streamed choice."""
        ...

    def streamer(self, index: int) -> ChoiceStreamer[StreamT]:
        """A fresh formatter for streamed choice `index` (called once per choice)."""
        ...

    def response(self, choices: list[WholeT], usage: Usage) -> BaseModel:
        """The non-streamed answer holding every choice in index order."""
        ...

    def chunk(self, choices: list[StreamT], usage: Usage | None) -> BaseModel:
        """One event of the stream (usage only on the last, usage-only one)."""
        ...


@dataclass(frozen=True)
class ChoiceRun(Generic[WholeT, StreamT]):
    """The admitted requests of one answer, what to read from their results and how."""

    reqs: list[GenerateRequest]  # index order of the choices
    n: int  # choices per prompt
    format: ChoiceFormat[WholeT, StreamT]
    output_logprobs: bool
    prompt_logprobs: bool = False  # the prompt's own logprobs (completions' echo)
    stream: bool = False
    include_usage: bool = False  # streamed: end with a usage-only chunk


async def respond(request: Request, state: ServerState, run: ChoiceRun[Any, Any]) -> Response:
    """Run every choice of `run` and answer: one JSON object, or an event stream."""
    if run.stream:
        stream = _ChoiceStream(run)
        events = stream_events(state, run.reqs, stream.on_chunk, stream.on_end)
        return stream_response(request, events)
    results = await run_until_disconnect(request, state.tokenizer_manager.generate(run.reqs))
    choices = []
    for k, result in enumerate(results):
        raise_if_aborted(state, result)
        choices.append(run.format.whole(_whole_output(run, k, result)))
    response = run.format.response(choices, usage_of(results, run.n))
    return Response(response.model_dump_json(), media_type="application/json")


def _whole_output(run: ChoiceRun[Any, Any], k: int, result: JSON) -> ChoiceOutput:
    meta = result["meta_info"]
    prompt = output = None
    if run.output_logprobs:
        output = LogprobEntries(meta["output_token_logprobs"], meta.get("output_top_logprobs"))
    if run.prompt_logprobs:
        prompt = LogprobEntries(meta["input_token_logprobs"], meta.get("input_top_logprobs"))
    reason, matched = finish_reason(meta)
    return ChoiceOutput(k, result["text"], prompt, output, reason, matched)


class _ChoiceStream:
    """The events of a streamed answer: per choice its opening, then an event for each output
    that carries something; with usage, a last usage-only chunk once every choice finished."""

    def __init__(self, run: ChoiceRun[Any, Any]) -> None:
        self.run = run
        count = len(run.reqs)
        self.streamers = [run.format.streamer(k) for k in range(count)]
        self.started = [False] * count
        self.prompt_sent = [0] * count  # prompt logprob entries already handed out
        self.finals: list[JSON | None] = [None] * count

    def _event(self, choices: list[Any], usage: Usage | None = None) -> JSON:
        return self.run.format.chunk(choices, usage).model_dump(mode="json")

    def _output(self, k: int, result: JSON) -> ChoiceOutput:
        meta = result["meta_info"]
        prompt = output = None
        if self.run.prompt_logprobs:
            # Streamed results repeat every prompt entry so far; they may arrive over several
            # increments (chunked prefill), so only the new tail is handed out.
            entries = meta.get("input_token_logprobs") or []
            start = self.prompt_sent[k]
            if len(entries) > start:
                tops = meta.get("input_top_logprobs")
                prompt = LogprobEntries(entries[start:], tops[start:] if tops else None)
                self.prompt_sent[k] = len(entries)
        # Output entries, by contrast, come only once: each increment holds just its new tokens.
        if self.run.output_logprobs and meta.get("output_token_logprobs"):
            output = LogprobEntries(meta["output_token_logprobs"], meta.get("output_top_logprobs"))
        reason, matched = finish_reason(meta)
        return ChoiceOutput(k, result["text"], prompt, output, reason, matched)

    def on_chunk(self, k: int, result: JSON) -> list[JSON]:
        events = []
        if not self.started[k]:
            self.started[k] = True
            opening = self.streamers[k].opening()
            if opening is not None:
                events.append(self._event([opening]))
        output = self._output(k, result)
        if output.finish_reason is not None:
            self.finals[k] = result
        choice = self.streamers[k].increment(output)
        if choice is not None:
            events.append(self._event([choice]))
        return events

    def on_end(self) -> list[JSON]:
        if not self.run.include_usage:
            return []
        done = [r for r in self.finals if r is not None]
        # A choice that never finished (cannot happen short of a runtime bug) zeroes the usage
        # rather than reporting a partial count as the whole.
        usage = usage_of(done, self.run.n) if len(done) == len(self.finals) else Usage()
        return [self._event([], usage)]


def finish_reason(meta: JSON) -> tuple[str | None, Any]:
    """("stop" or "length", the matched stop) of a finished result; (None, None) before."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    kind = "length" if reason.get("type") == "length" else "stop"
    return kind, reason.get("matched")


def usage_of(results: list[JSON], n: int) -> Usage:
    """Usage of finished results in index order, `n` choices per prompt."""
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


def stream_response(request: Request, events: AsyncIterator[bytes]) -> StreamingResponse:
    """An event-stream response that stops generating when the client goes away."""
    return StreamingResponse(
        iterate_until_disconnect(request, events),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )
