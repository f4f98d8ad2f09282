"""POST /v1/chat/completions: a conversation rendered through the model's chat template, with tool
calls (`chat_tools.py`) parsed out of the answer, whole or streamed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from sglite.http.errors import APIError, ErrorResponse
from sglite.http.streaming import sse_response_content
from sglite.runtime.reasoning import (
    ReasoningFormat,
    StreamingReasoningParser,
    get_reasoning_format,
)
from sglite.runtime.server.chat_tools import (
    ToolPlan,
    calls_json,
    delta_calls_json,
    parse_answer,
    plan_tools,
    prepare_messages,
    special_markers,
    stream_parser,
)
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.openai_choices import (
    ChoiceOutput,
    ChoiceRun,
    LogprobEntries,
    respond,
)
from sglite.runtime.server.openai_common import (
    GENERATE_ERRORS_CODES,
    OutputConstraint,
    check_common,
    finite,
    output_constraint,
    prepare,
    sampling_params,
)
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
from sglite.runtime.server.serving import bootstrap_of, get_state
from sglite.runtime.server.state import ServerState
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizing.request import GenerateRequest
from sglite.runtime.tool_calls.types import ToolCall

router = APIRouter(prefix="/v1")
_GENERATE_ERRORS = error_responses(*GENERATE_ERRORS_CODES)


def _content_parts(
    state: ServerState, content: list[Any], i: int, images: list[dict[str, str]]
) -> list[dict[str, str]]:
    """A content part list as the chat template's parts (`{"type": "text", "text": ...}` and,
    for each `image_url` part, `{"type": "image"}`, as transformers' processors give templates);
    each image's source is appended to `images` (labelled with where it came from)."""
    builder = state.tokenizer_manager.images
    parts = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
            continue
        where = f"messages.{i}.content.{j}"
        if part.type == "image_url" and builder is not None:
            url = getattr(part, "image_url", None)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{where}: image_url needs a url", param=where)
            images.append({"url": url, "label": where})
            parts.append({"type": "image"})
            continue
        kind = "text and image_url" if builder is not None else "text"
        raise APIError(
            400,
            f"{where}: only {kind} content parts are supported for this model "
            f"(got type {part.type!r})",
            param=f"messages.{i}.content",
            code="not_supported",
        )
    return parts


def _flatten(parts: list[dict[str, str]], image_token: str | None) -> str:
    """Parts as one text, each image part the model's image token (for templates that take a
    string content)."""
    return "".join(p["text"] if p["type"] == "text" else (image_token or "") for p in parts)


_PROBE_TEXT = "sglite-probe-text"
_TEMPLATE_TAKES_PARTS: dict[str, bool] = {}  # chat template -> whether it renders image parts


def _template_takes_parts(state: ServerState, image_token: str) -> bool:
    """Whether the chat template writes a message's image parts itself (`{"type": "image"}` in
    a content list, as LLaVA's templates do, e.g. as `<image>\\n`): tried once per template on
    one user message of an image and a text."""
    template = state.tokenizer.chat_template
    if template is None:
        return False
    if template not in _TEMPLATE_TAKES_PARTS:
        probe = [{"type": "image"}, {"type": "text", "text": _PROBE_TEXT}]
        try:
            text = state.tokenizer.apply_chat_template(
                [{"role": "user", "content": probe}], add_generation_prompt=True
            )
            takes = text.count(image_token) == 1 and _PROBE_TEXT in text and "'type'" not in text
        except Exception:  # a template that cannot render parts takes text
            takes = False
        _TEMPLATE_TAKES_PARTS[template] = takes
    return _TEMPLATE_TAKES_PARTS[template]


def _render_messages(
    state: ServerState, body: ChatCompletionRequest, plan: ToolPlan
) -> tuple[list[int], list[dict[str, str]], list[tuple[int, int]]]:
    """The prompt's token ids, its images (`image_url` parts, in order) and the token spans of
    the messages marked `"reuse": true` (their content is a reusable segment)."""
    messages = []
    images: list[dict[str, str]] = []
    builder = state.tokenizer_manager.images
    image_token = builder.image_token if builder is not None else None
    for i, msg in enumerate(body.messages):
        content: Any = msg.content
        if isinstance(content, list):
            parts = _content_parts(state, content, i, images)
            # A message with images goes to a template that renders image parts as its parts
            # (the template places the image token and what surrounds it, as transformers'
            # processor does); otherwise as text with the image token where each image was.
            with_image = any(p["type"] == "image" for p in parts)
            if with_image and _template_takes_parts(state, image_token):
                content = parts
            else:
                content = _flatten(parts, image_token)
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
    messages = prepare_messages(plan, messages)
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=not continue_final, tools=plan.tools, **kwargs
        )
    except Exception as exc:  # template errors (e.g. roles must alternate) are the client's
        raise APIError(
            400, f"messages: the chat template rejected them: {exc}", "messages"
        ) from None
    reused = _reused_spans(body, text)
    if reused:
        ids, spans = state.tokenizer_manager.encode_with_segments(text, reused)
    else:
        ids, spans = state.tokenizer.encode(text), []
    bos = state.tokenizer.bos_token_id
    # Templates that write the BOS text themselves get a second BOS from the tokenizer.
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids, spans = ids[1:], [(a - 1, b - 1) for a, b in spans]
    return ids, images, spans


def _reused_spans(body: ChatCompletionRequest, text: str) -> list[tuple[int, int]]:
    """Character spans in the rendered `text` of the contents of messages marked `"reuse":
    true` (found in order; a content the template changed cannot be marked: 400)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(body.messages):
        if (msg.model_extra or {}).get("reuse") is not True:
            continue
        content = msg.content
        start = text.find(content, cursor) if isinstance(content, str) and content else -1
        if start < 0:
            raise APIError(
                400,
                f"messages[{i}].reuse: only a message with text content the chat template "
                "keeps as it is can be reused",
                param=f"messages[{i}].reuse",
            )
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def _reasoning_format(state: ServerState, body: ChatCompletionRequest) -> ReasoningFormat | None:
    """The server's reasoning format, unless the request keeps reasoning in the content."""
    name = state.args.reasoning_parser
    if name is None or body.separate_reasoning is False:
        return None
    return get_reasoning_format(name)


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


@dataclass
class ChatAnswer:
    """A finished answer split into reasoning, text and tool calls."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]


@dataclass
class PreparedChat:
    """A chat request checked, rendered and turned into scheduler requests, with what reading
    its answers needs (shared by /v1/chat/completions and /v1/responses)."""

    reqs: list[GenerateRequest]
    plan: ToolPlan
    reasoning: ReasoningFormat | None
    n: int
    base_id: str
    want_logprobs: bool
    num_top: int
    prompt_ids: list[int]

    def answer(self, text: str) -> ChatAnswer:
        """The reasoning, text and calls of one finished output."""
        reasoning, rest = (None, text) if self.reasoning is None else self.reasoning.split(text)
        parsed = parse_answer(self.plan, rest)
        return ChatAnswer(reasoning, parsed.content, parsed.calls)


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> PreparedChat:
    """Check `body` (400 naming the field), render it and admit its scheduler requests."""
    check_common(state, body)
    constraint = output_constraint(body)
    plan = plan_tools(state, body)
    if plan.grammar is not None:
        if constraint is not None:
            raise APIError(
                400,
                f"{constraint.field.split('.')[0]}: cannot be combined with enforced tool calls "
                "(tool_choice required, a named function, or strict tools)",
                param=constraint.field.split(".")[0],
            )
        constraint = OutputConstraint("ebnf", plan.grammar, "tools")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
    ids, images, segments = _render_messages(state, body, plan)
    tm = state.tokenizer_manager
    items = None
    if images:
        try:
            prepared = await tm.prepare_images(images, "messages")
            ids, items = tm.expand_images(ids, prepared, "messages")
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_budget(state.args, len(ids), min(tm.context_len, tm.max_total_tokens))
    base_id = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    params = sampling_params(body, max_tokens, constraint)
    if special_markers(state, plan):
        params["skip_special_tokens"] = False
    want_logprobs = bool(body.logprobs)
    num_top = body.top_logprobs or 0
    reqs = prepare(
        state,
        "messages",
        constraint,
        text=None,
        input_ids=ids,
        sampling_params=params,
        return_logprob=want_logprobs,
        logprob_start_len=-1,
        top_logprobs_num=num_top,
        return_text_in_logprobs=True,
        rid=base_id,
        image_items=items,
        bootstrap=bootstrap_of(state, body),
        segments=[list(span) for span in segments] or None,
    )
    reasoning = _reasoning_format(state, body)
    return PreparedChat(reqs, plan, reasoning, body.n or 1, base_id, want_logprobs, num_top, ids)


def default_budget(args: ServerArgs, prompt_tokens: int, room: int) -> int:
    """New tokens for a chat without max_tokens: the rest of the context (or of the KV pool,
    `room`), at most `--default-max-tokens` (0: no cap) and `--max-new-tokens-limit`."""
    budget = max(0, room - prompt_tokens)
    for cap in (args.default_max_tokens or None, args.max_new_tokens_limit):
        if cap is not None:
            budget = min(budget, cap)
    return budget


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
