"""Llama 3.1 / 3.2 JSON calls: `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or
alone), several separated by `;`."""

from __future__ import annotations

import re
from typing import Any

from sglite.runtime.tool_calls.base import ToolCallFormat, calls_schema
from sglite.runtime.tool_calls.json_scan import read_call_object, value_end
from sglite.runtime.tool_calls.types import RegionParse, ToolCall

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;?\s*")


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3"
    markers = (PYTHON_TAG,)
    leading = ('{"name"', '{ "name"')

    def detect(self, chat_template: str) -> bool:
        return PYTHON_TAG in chat_template or "respond with a JSON for a function call" in (
            chat_template
        )

    def parse_region(self, region: str) -> RegionParse:
        region = region.removeprefix(PYTHON_TAG)
        calls: list[ToolCall] = []
        pos = 0
        while True:
            gap = _SEPARATOR.match(region, pos).end()  # type: ignore[union-attr]
            if gap == len(region):
                return RegionParse(calls, len(calls), bool(calls))
            if region[gap] != "{":
                return RegionParse(calls, len(calls), False)
            partial = read_call_object(region[gap:])
            closed = len(calls)
            if partial.name is not None:
                calls.append(ToolCall(partial.name, partial.arguments))
            end = value_end(region, gap)
            if not partial.complete or end is None:
                return RegionParse(calls, closed, False)
            pos = end

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, allow_text: bool) -> str:
        schema = calls_schema(tools, "parameters")
        lines = ['calls: call ("; " call)*' if parallel else "calls: call", f"call: %json {schema}"]
        if allow_text:
            return "\n".join(["start: TEXT | calls", "TEXT: /([^{](.|\\n)*)?/", *lines])
        return "\n".join(["start: calls", *lines])
