"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` objects."""

from __future__ import annotations

import re
from typing import Any

from sglite.runtime.tool_calls.base import ToolCallFormat, calls_schema, lark_string
from sglite.runtime.tool_calls.json_scan import read_call_object, value_end
from sglite.runtime.tool_calls.types import RegionParse, ToolCall

MARKER = "[TOOL_CALLS]"
_ITEM_GAP = re.compile(r"\s*,?\s*")


class MistralFormat(ToolCallFormat):
    name = "mistral"
    markers = (MARKER,)

    def detect(self, chat_template: str) -> bool:
        return MARKER in chat_template

    def parse_region(self, region: str) -> RegionParse:
        body = region.removeprefix(MARKER).lstrip()
        if not body.startswith("["):
            return RegionParse([], 0, False)
        calls: list[ToolCall] = []
        pos = 1
        while True:
            pos = _ITEM_GAP.match(body, pos).end()  # type: ignore[union-attr]
            if pos == len(body):
                return RegionParse(calls, len(calls), False)
            if body[pos] == "]":
                ok = bool(calls) and not body[pos + 1 :].strip()
                return RegionParse(calls, len(calls), ok)
            partial = read_call_object(body[pos:])
            closed = len(calls)
            if partial.name is not None:
                calls.append(ToolCall(partial.name, partial.arguments))
            end = value_end(body, pos)
            if not partial.complete or end is None:
                return RegionParse(calls, closed, False)
            pos = end

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, allow_text: bool) -> str:
        lines = [
            f"calls: {lark_string(MARKER + '[')} call "
            + ('(", " call)* "]"' if parallel else '"]"'),
            f"call: %json {calls_schema(tools)}",
        ]
        if allow_text:
            return "\n".join(["start: TEXT | calls", "TEXT: /([^\\[](.|\\n)*)?/", *lines])
        return "\n".join(["start: calls", *lines])
