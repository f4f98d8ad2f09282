"""What a tool-call format is, and the streaming parser every format shares."""

from __future__ import annotations

import abc
import json
from typing import Any

from sglite.runtime.tool_calls.lenient import lenient_call, may_become_call
from sglite.runtime.tool_calls.types import (
    CallDelta,
    ParsedOutput,
    RegionParse,
    StreamDelta,
    ToolCall,
)

# The JSON layout the grammar engine enforces inside calls (llguidance's `x-guidance` options):
# the separators a model usually writes, no free whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def function_schema(tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object of `tool` (an OpenAI `{"type": "function", ...}`):
    its name as a constant, its arguments as the function's `parameters` schema."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, args_key: parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def calls_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> str:
    """`%json` text of one call of any of `tools` (a single tool needs no `anyOf`)."""
    options = [function_schema(t, args_key) for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


class ToolCallFormat(abc.ABC):
    """One way models write calls. `markers` are the texts that open a call region in the
    output; before the first one is text. Formats implement `parse_region` (the calls of a
    region, possibly cut short) and `grammar` (a Lark grammar for llguidance producing only
    calls of the given tools)."""

    name: str = ""
    markers: tuple[str, ...] = ()
    # A call region may also begin at the very start of the output with one of these.
    leading: tuple[str, ...] = ()

    @abc.abstractmethod
    def detect(self, chat_template: str) -> bool:
        """Whether a chat template renders tools for this format."""

    @abc.abstractmethod
    def parse_region(self, region: str) -> RegionParse:
        """What a call region (the output from its start, possibly cut short) holds."""

    @abc.abstractmethod
    def grammar(self, tools: list[dict[str, Any]], parallel: bool, allow_text: bool) -> str:
        """A Lark grammar of one call (or several with `parallel`) of `tools`; with
        `allow_text`, plain text not opening a call region is accepted too. Markers are written
        as text: where the model's vocabulary holds one as a special token (Qwen2.5's
        `<tool_call>`), the grammar engine names that token instead
        (`llguidance_backend.name_special_tokens`), so the model writes the token it was
        trained to write."""

    def region_start(self, text: str) -> int | None:
        """Where the call region begins in `text`, if it does."""
        stripped = text.lstrip()
        if self.leading and stripped.startswith(self.leading):
            return len(text) - len(stripped)
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` may be the start of a marker (all of it when
        the output so far may still open with a leading one): kept out of content until the
        next update shows what they are."""
        stripped = text.lstrip()
        if stripped and any(lead.startswith(stripped) for lead in self.leading):
            return len(text)
        for n in range(max((len(m) for m in self.markers), default=1) - 1, 0, -1):
            if any(m.startswith(text[-n:]) for m in self.markers) and len(text) >= n:
                return n
        return 0

    def parse(self, text: str) -> ParsedOutput:
        """A finished output's text and calls; a malformed call region stays text."""
        start = self.region_start(text)
        if start is None:
            return ParsedOutput(text, [])
        region = self.parse_region(text[start:])
        if not region.ok or not region.calls:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].rstrip(), region.calls)


class StreamingToolParser:
    """Turns the growing text of one output into content and call deltas.

    Invariants: content never includes any part of a call region (text that may open one is
    held back until it cannot), and each call's deltas concatenate to its final id, name and
    arguments. `eager` (the output is grammar-constrained, so calls always parse) sends a call's
    id and name as soon as they are known and its arguments as they arrive; otherwise a call is
    sent whole once it is closed, so a malformed region, which `finish` turns into content,
    never leaks a call.
    """

    def __init__(
        self,
        fmt: ToolCallFormat,
        eager: bool = False,
        lenient_tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """`lenient_tools`: the declared tools, for an output that is one plain call object
        (`lenient.py`); such an output is held back until it is finished."""
        self.fmt = fmt
        self.eager = eager
        self.lenient_tools = lenient_tools
        self.sent_content = 0  # characters of the output sent as content
        self.region: int | None = None
        self.calls: list[ToolCall] = []  # what was sent of each call (name, arguments so far)

    def update(self, text: str) -> StreamDelta:
        """The delta from the previous update to `text` (the whole output so far)."""
        if self.region is None:
            self.region = self.fmt.region_start(text)
        if self.region is None:
            lenient = self.lenient_tools is not None and self.sent_content == 0
            if lenient and may_become_call(text):
                return StreamDelta()
            return self._content(text, len(text) - self.fmt.held_back(text))
        delta = self._content(text, self.region)
        parsed = self.fmt.parse_region(text[self.region :])
        ready = parsed.calls if self.eager else parsed.calls[: parsed.closed]
        delta.calls = self._call_deltas(ready)
        return delta

    def finish(self, text: str) -> StreamDelta:
        """The last delta: the rest of the content, or a malformed region as content."""
        if self.region is None:
            self.region = self.fmt.region_start(text)
        if self.region is None:
            call = None
            if self.lenient_tools is not None and self.sent_content == 0:
                call = lenient_call(text, self.lenient_tools)
            if call is None:
                return self._content(text, len(text))
            self.sent_content = len(text)
            self.calls.append(call)
            return StreamDelta(calls=[CallDelta(0, call.id, call.name, call.arguments)])
        parsed = self.fmt.parse_region(text[self.region :])
        if not parsed.ok and not self.calls:
            return self._content(text, len(text))
        delta = self._content(text, self.region)
        delta.calls = self._call_deltas(parsed.calls)
        return delta

    def _content(self, text: str, end: int) -> StreamDelta:
        end = max(end, self.sent_content)
        piece = text[self.sent_content : end]
        self.sent_content = end
        return StreamDelta(content=piece)

    def _call_deltas(self, calls: list[ToolCall]) -> list[CallDelta]:
        out: list[CallDelta] = []
        for index, call in enumerate(calls):
            if not call.name:
                break  # its name is not known yet: later calls cannot be either
            if index == len(self.calls):
                self.calls.append(ToolCall(call.name, "", call.id))
                out.append(CallDelta(index, id=call.id, name=call.name))
            sent = self.calls[index]
            grown = call.arguments.startswith(sent.arguments)
            if not grown or len(call.arguments) == len(sent.arguments):
                continue
            piece = call.arguments[len(sent.arguments) :]
            sent.arguments = call.arguments
            if out and out[-1].index == index:
                out[-1].arguments += piece
            else:
                out.append(CallDelta(index, arguments=piece))
        return out
