"""The streamed answer of `POST /v1/responses` with `stream`: the Responses API's server-sent
events (`event:` and `data:` lines, numbered by `sequence_number`), built as the model's text
arrives.

Invariants: at most one output item is open (receiving deltas) at a time, and it is closed
(its `.done` events sent) before the next opens; a stored response is put in the store only
after `response.completed` was sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sglite.http.errors import error_body
from sglite.http.streaming import to_json
from sglite.runtime.reasoning import StreamingReasoningParser
from sglite.runtime.server.chat_tools import stream_parser
from sglite.runtime.server.prepared_chat import PreparedChat
from sglite.runtime.server.responses_output import (
    call_item,
    conversation_after,
    message_item,
    reasoning_item,
    response_object,
)
from sglite.runtime.server.responses_protocol import ResponsesRequest
from sglite.runtime.server.serving import abort_event
from sglite.runtime.server.state import ServerState


class ResponseStream:
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
            conversation = conversation_after(self.conversation, answer)
            self.state.responses.put(response, conversation)
