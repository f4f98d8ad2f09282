"""The values tool-call parsing produces."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    """A finished output split into its text and its calls (in order)."""

    content: str
    calls: list[ToolCall]


@dataclass
class RegionParse:
    """The calls of a call region so far (the last possibly cut short, with what is known of
    it), how many of them are closed, and whether the whole region is finished and well formed.
    `complete` also counts a last call whose arguments are whole but whose end marker never
    came (the output was cut there); None when it equals `closed`.
    """

    calls: list[ToolCall]
    closed: int
    ok: bool
    complete: int | None = None

    @property
    def whole_calls(self) -> list[ToolCall]:
        """The calls whose arguments are whole (closed, or cut only before the end marker)."""
        return self.calls[: self.closed if self.complete is None else self.complete]


@dataclass
class CallDelta:
    """A streamed piece of call `index`: its id and name (first piece only) and/or more
    argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one stream update adds: content text and call pieces."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
