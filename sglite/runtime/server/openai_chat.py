"""POST /v1/chat/completions: a conversation rendered through the model's chat template, with tool
calls (`chat_tools.py`) parsed out of the answer, whole or streamed.

The request is prepared in `prepared_chat.py` (its prompt rendered in `chat_prompt.py`); this
module turns the answers into chat choices: whole assistant messages, or streamed deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from sglite.http.errors import ErrorResponse
from sglite.http.streaming import sse_response_content
from sglite.runtime.reasoning import StreamingReasoningParser
from sglite.runtime.server.chat_tools import calls_json, delta_calls_json, stream_parser
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.openai_choices import (
    ChoiceOutput,
    ChoiceRun,
    LogprobEntries,
    respond,
)
from sglite.runtime.server.openai_common import GENERATE_ERRORS_CODES, finite
from sglite.runtime.server.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from sglite.runtime.server.prepared_chat import PreparedChat, prepare_chat
from sglite.runtime.server.serving import get_state

router = APIRouter(prefix="/v1")
_GENERATE_ERRORS = error_responses(*GENERATE_ERRORS_CODES)


def _chat_logprobs(entries: LogprobEntries, num_top: int) -> ChoiceLogprobs:
    """Chat logprobs of `entries`, at most `num_top` alternatives per token."""
    content = []
    tops = entries.tops
    for k, (logprob, _tid, text) in enumerate(entries.entries):
        text = text or ""
        top = tops[k] if tops is not None and k < len(tops) and tops[k] else []
        content.append(
            TokenLogprob(
                token=text,
                logprob=finite(logprob),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=t or "", logprob=finite(lp), bytes=list((t or "").encode()))
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
    """Answer a conversation, rendered through the model's chat template; tool calls in the
    answer come back as `message.tool_calls` (`chat_tools.py`)."""
    state = get_state(request)
    chat = await prepare_chat(state, body)
    run = ChoiceRun(
        chat.reqs,
        chat.n,
        _ChatFormat(chat, body.model or state.model_name),
        output_logprobs=chat.want_logprobs,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
    return await respond(request, state, run)


def _finish(reason: str | None, calls: bool) -> str | None:
    # A stop after tool calls is OpenAI's `tool_calls`; a length cut stays `length`.
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(frozen=True)
class _ChatFormat:
    """Chat choices: an assistant message (reasoning, content, tool calls) when whole; streamed,
    a role delta, then content, reasoning and tool-call deltas, then the finish reason."""

    chat: PreparedChat
    model: str

    def whole(self, output: ChoiceOutput) -> ChatChoice:
        logprobs = None
        if output.output_logprobs is not None:
            logprobs = _chat_logprobs(output.output_logprobs, self.chat.num_top)
        reason = output.finish_reason
        answer = self.chat.answer(output.text)
        message = AssistantMessage(
            content=answer.content or None, reasoning_content=answer.reasoning
        )
        if answer.calls:
            message.tool_calls = calls_json(answer.calls)
            reason = _finish(reason, True)
        elif message.content is None:
            message.content = ""
        return ChatChoice(
            index=output.index, message=message, logprobs=logprobs,
            finish_reason=reason, matched_stop=output.matched_stop,  # type: ignore[arg-type]
        )  # fmt: skip

    def streamer(self, index: int) -> _ChatStreamer:
        return _ChatStreamer(self.chat, index)

    def response(self, choices: list[ChatChoice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.chat.base_id, model=self.model, choices=choices, usage=usage
        )

    def chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.chat.base_id, model=self.model, choices=choices, usage=usage
        )


class _ChatStreamer:
    """One streamed chat choice: reasoning split off first (`--reasoning-parser`), then tool-call
    text held back from the content (`chat_tools.stream_parser`)."""

    def __init__(self, chat: PreparedChat, index: int) -> None:
        self.chat, self.index = chat, index
        self.sent = 0  # characters of the answer already sent (without a tool parser)
        self.parser = stream_parser(chat.plan)
        self.reasoner = StreamingReasoningParser(chat.reasoning) if chat.reasoning else None

    def opening(self) -> ChatStreamChoice:
        delta = DeltaMessage(role="assistant", content="")
        return ChatStreamChoice(index=self.index, delta=delta)

    def _delta(self, text: str, done: bool) -> DeltaMessage:
        reasoning = None
        if self.reasoner is not None:  # the answer follows the reasoning
            reasoning, text = self.reasoner.update(text, done)
        parser = self.parser
        if parser is None:
            piece = text[self.sent :]
            self.sent = len(text)
            return DeltaMessage(content=piece or None, reasoning_content=reasoning or None)
        update = parser.finish(text) if done else parser.update(text)
        calls = delta_calls_json(update)
        return DeltaMessage(
            content=update.content or None,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )

    def increment(self, output: ChoiceOutput) -> ChatStreamChoice | None:
        reason = output.finish_reason
        delta = self._delta(output.text, reason is not None)
        logprobs = None
        if output.output_logprobs is not None:
            logprobs = _chat_logprobs(output.output_logprobs, self.chat.num_top)
        if reason is not None:
            reason = _finish(reason, self.parser is not None and bool(self.parser.calls))
        new = delta.content or delta.reasoning_content or delta.tool_calls
        if not new and logprobs is None and reason is None:
            return None
        return ChatStreamChoice(
            index=self.index, delta=delta, logprobs=logprobs,
            finish_reason=reason, matched_stop=output.matched_stop,  # type: ignore[arg-type]
        )  # fmt: skip


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
