"""Hermes / Qwen2.5 / Qwen3: each call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import re
from typing import Any

from sglite.runtime.tool_calls.base import ToolCallFormat, calls_schema, lark_string
from sglite.runtime.tool_calls.json_scan import read_call_object, value_end
from sglite.runtime.tool_calls.types import RegionParse, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_GAP = re.compile(r"\s*")


class HermesFormat(ToolCallFormat):
    name = "hermes"
    markers = (OPEN,)

    def detect(self, chat_template: str) -> bool:
        return OPEN in chat_template

    def parse_region(self, region: str) -> RegionParse:
        calls: list[ToolCall] = []
        pos = 0
        while True:
            pos = _GAP.match(region, pos).end()  # type: ignore[union-attr]
            if pos == len(region):
                return RegionParse(calls, len(calls), bool(calls))
            if not region.startswith(OPEN, pos):
                return RegionParse(calls, len(calls), False)
            start = _GAP.match(region, pos + len(OPEN)).end()  # type: ignore[union-attr]
            partial = read_call_object(region[start:])
            closed = len(calls)
            if partial.name is not None:
                calls.append(ToolCall(partial.name, partial.arguments))
            end = value_end(region, start) if start < len(region) else None
            if not partial.complete or end is None:
                return RegionParse(calls, closed, False)
            after = _GAP.match(region, end).end()  # type: ignore[union-attr]
            if not region.startswith(CLOSE, after):
                cut = CLOSE.startswith(region[after:])  # the output ended before the marker
                return RegionParse(calls, closed, False, len(calls) if cut else None)
            pos = after + len(CLOSE)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, allow_text: bool) -> str:
        # The markers are literals of their own, so the engine can name each as its token.
        open_, close = lark_string(OPEN), lark_string(CLOSE)
        lines = [
            # A newline may end the calls: Qwen2.5 writes one after `</tool_call>` before it
            # stops (or opens the next call).
            'calls: call ("\\n" call)* "\\n"?' if parallel else 'calls: call "\\n"?',
            f'call: {open_} "\\n" %json {calls_schema(tools)} "\\n" {close}',
        ]
        if allow_text:  # text that does not open a call, or calls
            return "\n".join(["start: TEXT | calls", "TEXT: /([^<](.|\\n)*)?/", *lines])
        return "\n".join(["start: calls", *lines])
