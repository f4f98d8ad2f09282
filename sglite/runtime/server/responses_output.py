"""The output side of the Responses API: output items (reasoning, message, function call) made
from a chat answer, the response object around them, and the conversation a stored response
keeps for a follow-up (`previous_response_id`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sglite.runtime.server.prepared_chat import ChatAnswer
from sglite.runtime.server.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    """A fresh id of a Responses API object: `prefix`, an underscore, 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": new_id("rs"),
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


def conversation_after(conversation: list[dict[str, Any]], answer: ChatAnswer) -> list[dict]:
    reply: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
    if answer.calls:
        reply["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in answer.calls
        ]
    return [*conversation, reply]
