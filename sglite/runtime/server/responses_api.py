"""The OpenAI Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`.

A request becomes a chat completion (`openai_chat.prepare_chat`): `instructions` as the system
message, `input` (text, or message and function-call items) after the conversation of
`previous_response_id`, tools and `text.format` translated to their chat forms. Its answer
becomes output items: reasoning, a message with `output_text`, and `function_call`s. Stored
responses (`store`, the default) keep their conversation in a bounded LRU (`--max-stored-responses`
entries), so a follow-up names only its new input and its prompt starts with the cached prefix.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sglite.http.errors import APIError, ErrorResponse, error_body
from sglite.http.streaming import (
    SSE_HEADERS,
    iterate_until_disconnect,
    run_until_disconnect,
    sse_response_content,
    to_json,
)
from sglite.runtime.reasoning import StreamingReasoningParser
from sglite.runtime.server.chat_tools import stream_parser
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.openai_chat import ChatAnswer, PreparedChat, prepare_chat
from sglite.runtime.server.openai_protocol import ChatCompletionRequest
from sglite.runtime.server.serving import abort_event, get_state, raise_if_aborted
from sglite.runtime.server.state import ServerState
from sglite.runtime.server.types import Bool, Float, Int, Text

router = APIRouter(prefix="/v1")


class ResponsesRequest(BaseModel):
    """POST /v1/responses (the fields sglite acts on; others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    input: Text | list[dict[str, Any]]
    model: str | None = None
    instructions: Text | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Int | None = None
    stream: Bool | None = False
    store: Bool | None = True
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- requests
def _text_of(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(
                400,
                f"{field}.{j}: only text content is supported (got {kind!r})",
                param=field,
                code="not_supported",
            )
        parts.append(part.get("text") or "")
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: text and message items as they are, function calls as an
    assistant message with `tool_calls`, their outputs as `tool` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        field = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{field}.role: unknown role {role!r}", param=f"{field}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), field)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue  # the model's earlier reasoning is not sent back to it
        else:
            raise APIError(400, f"{field}.type: unsupported item {kind!r}", param=f"{field}.type")
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tools.{i}.type: only function tools are supported (got {tool.get('type')!r})",
                param=f"tools.{i}.type",
                code="not_supported",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completion a Responses request is, and the conversation without instructions."""
    conversation = [*history, *input_messages(body.input)]
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    chat = ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": messages,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "seed": body.seed,
            "tools": _chat_tools(body.tools),
            "tool_choice": _chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body.text),
        }
    )
    return chat, conversation


# ---------------------------------------------------------------------------- responses
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": _new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def output_items(answer: ChatAnswer) -> list[dict[str, Any]]:
    items = [reasoning_item(answer.reasoning)] if answer.reasoning else []
    if answer.content:
        items.append(message_item(answer.content))
    items += [call_item(c.id, c.name, c.arguments) for c in answer.calls]
    return items


def response_object(
    response_id: str,
    body: ResponsesRequest,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    meta: dict[str, Any] | None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    usage = None
    if meta is not None:
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion,
        }
    incomplete = status == "incomplete"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": body.text or {"format": {"type": "text"}},
        "metadata": body.metadata or {},
        "store": body.store is not False,
    }


def _conversation_after(conversation: list[dict[str, Any]], answer: ChatAnswer) -> list[dict]:
    reply: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
    if answer.calls:
        reply["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in answer.calls
        ]
    return [*conversation, reply]


def _reasoning_tokens(state: ServerState, answer: ChatAnswer) -> int:
    return len(state.tokenizer.encode(answer.reasoning)) if answer.reasoning else 0


class ResponseObject(BaseModel):
    """A response (the fields clients read; `output` items as the module docstring says)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One streamed event: its `type` (response.created, response.output_text.delta, ...) and
    sequence number, with the fields of that type."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


@router.post(
    "/responses",
    response_model=ResponseObject,
    responses={
        200: {
            "description": "a response, or with `stream` its events (`event:` and `data:` lines)",
            "content": sse_response_content(ResponseStreamEvent, ErrorResponse),
        },
        **error_responses(400, 401, 413, 503, 504),
    },
)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    """Answer `input` (after the conversation of `previous_response_id`) as a response."""
    state = get_state(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        entry = state.responses.get(body.previous_response_id)
        if entry is None:
            raise APIError(
                400,
                f"previous_response_id: no stored response {body.previous_response_id!r}",
                param="previous_response_id",
            )
        history = entry[1]
    chat_body, conversation = chat_request(body, history)
    chat = await prepare_chat(state, chat_body)
    model = body.model or state.model_name
    response_id = _new_id("resp")
    if body.stream:
        events = _ResponseStream(state, chat, body, model, response_id, conversation).events()
        return StreamingResponse(
            iterate_until_disconnect(request, events),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    (result,) = await run_until_disconnect(request, state.tokenizer_manager.generate(chat.reqs))
    raise_if_aborted(state, result)
    meta = result["meta_info"]
    answer = chat.answer(result["text"])
    status = "incomplete" if (meta["finish_reason"] or {}).get("type") == "length" else "completed"
    response = response_object(
        response_id, body, model, output_items(answer), status, meta,
        _reasoning_tokens(state, answer),
    )  # fmt: skip
    if body.store is not False:
        state.responses.put(response, _conversation_after(conversation, answer))
    return Response(to_json(response), media_type="application/json")


@router.get(
    "/responses/{response_id}", response_model=ResponseObject, responses=error_responses(401, 404)
)
async def retrieve_response(response_id: str, request: Request) -> Any:
    """A stored response."""
    entry = get_state(request).responses.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id")
    return Response(to_json(entry[0]), media_type="application/json")


class _ResponseStream:
    """The Responses API's streaming events for one answer: created, in_progress, then per
    output item `output_item.added`, its text or argument deltas and `.done` events, then
    `response.completed` with the whole response."""

    def __init__(
        self,
        state: ServerState,
        chat: PreparedChat,
        body: ResponsesRequest,
        model: str,
        response_id: str,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.state, self.chat, self.body, self.model = state, chat, body, model
        self.response_id, self.conversation = response_id, conversation
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items so far
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.reasoner = StreamingReasoningParser(chat.reasoning) if chat.reasoning else None
        self.parser = stream_parser(chat.plan)
        self.sent = 0

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {to_json(payload)}\n\n".encode()

    def _response(self, status: str, meta: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(self.response_id, self.body, self.model, self.items, status, meta)

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )  # fmt: skip
            )
        return events

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event("response.output_text.done", text=text, **ids))
            events.append(self._event("response.content_part.done", part=item["content"][0], **ids))
        elif item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )  # fmt: skip
            )
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )  # fmt: skip
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, kind: str, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = []
        if self.open is None or self.open["type"] != kind:
            fresh = message_item("", "in_progress") if kind == "message" else reasoning_item("")
            events += self._open(fresh)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += delta
        index = len(self.items) - 1
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events.append(self._event(name, delta=delta, **ids))
        return events

    def _update(self, text: str, done: bool) -> list[bytes]:
        events: list[bytes] = []
        if self.reasoner is not None:
            thought, text = self.reasoner.update(text, done)
            events += self._text("reasoning", thought)
        if self.parser is None:
            piece, self.sent = text[self.sent :], len(text)
            return events + self._text("message", piece)
        delta = self.parser.finish(text) if done else self.parser.update(text)
        events += self._text("message", delta.content)
        for piece in delta.calls:
            if piece.id is not None:
                item = call_item(piece.id, piece.name or "", "", "in_progress")
                events += self._open(item)
            item = self.open
            if item is None or item["type"] != "function_call" or not piece.arguments:
                continue
            item["arguments"] += piece.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    delta=piece.arguments,
                )  # fmt: skip
            )
        return events

    async def events(self) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self._response("in_progress", None))
        yield self._event("response.in_progress", response=self._response("in_progress", None))
        tm = self.state.tokenizer_manager
        final: dict[str, Any] | None = None
        try:
            async for chunk in tm.stream(self.chat.reqs[0]):
                error = abort_event(self.state, chunk)
                if error is not None:
                    yield self._event("error", **error["error"])
                    return
                done = chunk["meta_info"]["finish_reason"] is not None
                for event in self._update(chunk["text"], done):
                    yield event
                if done:
                    final = chunk
        except Exception as exc:
            body = error_body(503 if not self.state.client.alive else 500, str(exc))
            yield self._event("error", **body["error"])
            return
        for event in self._close():
            yield event
        assert final is not None
        meta = final["meta_info"]
        status = "incomplete" if meta["finish_reason"].get("type") == "length" else "completed"
        response = self._response(status, meta)
        yield self._event("response.completed", response=response)
        if self.body.store is not False:
            answer = self.chat.answer(final["text"])
            conversation = _conversation_after(self.conversation, answer)
            self.state.responses.put(response, conversation)


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
