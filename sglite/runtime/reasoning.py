"""Separating a thinking model's reasoning (`<think>...</think>`) from its answer, whole or
streamed (`--reasoning-parser`).

Qwen3 writes the block itself (and none when `enable_thinking` is false: its template then
puts an empty one in the prompt); DeepSeek-R1 distills' templates open the block in the prompt,
so their output starts inside it and only closes it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    """`start`/`end` enclose the reasoning; `starts_inside`: the prompt opened the block."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a finished output; reasoning is None when there is none."""
        reasoning, answer, _ = self._split(text, final=True)
        return reasoning, answer

    def _split(self, text: str, final: bool) -> tuple[str | None, str, int]:
        """(reasoning so far, answer so far, characters held back as a possible marker)."""
        body = text.lstrip()
        if not final and len(body) < len(self.start) and self.start.startswith(body):
            return None, "", len(text)  # may still open the block
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif not self.starts_inside:
            return None, text, 0
        end = body.find(self.end)
        if end >= 0:
            return body[:end].lstrip(), body[end + len(self.end) :].lstrip(), 0
        held = 0 if final else _prefix_overlap(body, self.end)
        return body[: len(body) - held].lstrip(), "", held


def _prefix_overlap(text: str, marker: str) -> int:
    """How many trailing characters of `text` begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_inside=True),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format called `name`; ValueError listing the choices otherwise."""
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


class StreamingReasoningParser:
    """Splits the growing text of one output into reasoning deltas and the answer so far.

    Invariant: the reasoning deltas concatenate to `split(final text)[0]` and no part of the
    markers is ever sent as reasoning or answer.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.sent = 0  # characters of reasoning sent

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning text, the whole answer so far) for the output so far."""
        reasoning, answer, _ = self.fmt._split(text, final)
        reasoning = reasoning or ""
        piece = reasoning[self.sent :] if len(reasoning) > self.sent else ""
        self.sent = max(self.sent, len(reasoning))
        return piece, answer
