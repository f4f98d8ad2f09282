"""A Responses request as the chat completion it is: `instructions` as the system message,
`input` (text, or message and function-call items) as chat messages after the stored
conversation, function tools, `tool_choice` and `text.format` in their chat forms.

Invariants: only text content and function tools are supported (anything else is a 400 naming
the field); the conversation returned (for storing) excludes the instructions, which each
request gives anew.
"""

from __future__ import annotations

import json
from typing import Any

from sglite.http.errors import APIError
from sglite.runtime.server.openai_protocol import ChatCompletionRequest
from sglite.runtime.server.responses_protocol import ResponsesRequest


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
