"""Reading JSON values out of text that may still be arriving (a stream's prefix)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r',\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class JsonNesting:
    """Where JSON text read so far stands: how many arrays and objects are open, and whether
    it is inside a string (brackets inside strings and escaped quotes do not count; the text is
    not otherwise validated)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def read(self, ch: str) -> None:
        """Take the next character."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]" and self.depth > 0:
            self.depth -= 1

    @classmethod
    def of(cls, text: str) -> JsonNesting:
        """The nesting after `text`."""
        nesting = cls()
        for ch in text:
            nesting.read(ch)
        return nesting


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array starting at `text[start]`, or None while it
    is not closed yet, or there is none (see `JsonNesting`)."""
    if start >= len(text) or text[start] not in "{[":
        return None
    nesting = JsonNesting()
    for i in range(start, len(text)):
        nesting.read(text[i])
        if nesting.depth == 0 and not nesting.in_string and text[i] in "}]":
            return i + 1
    return None


@dataclass
class PartialCall:
    """What is known of a call object `{"name": ..., "arguments": {...}}` so far."""

    name: str | None  # once its string is closed
    arguments: str  # the arguments value's text so far (all of it once `complete`)
    complete: bool  # the object is closed and parses


def read_call_object(text: str) -> PartialCall:
    """A call object (name first, then `arguments` or `parameters`) from the start of `text`,
    which may be cut anywhere."""
    name_match = _NAME.match(text)
    if name_match is None:
        return PartialCall(None, "", False)
    name = json.loads(f'"{name_match.group(1)}"')
    args_match = _ARGS.match(text, name_match.end())
    if args_match is None:
        return PartialCall(name, "", False)
    start = args_match.end()
    end = value_end(text, start) if start < len(text) and text[start] in "{[" else None
    if end is None:
        return PartialCall(name, text[start:].rstrip(), False)
    obj_end = value_end(text, text.index("{"))
    complete = obj_end is not None and _parses(text[:obj_end])
    return PartialCall(name, text[start:end], complete)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
