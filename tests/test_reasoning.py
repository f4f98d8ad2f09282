"""Separating `<think>` reasoning from the answer, whole and streamed at every split."""

from __future__ import annotations

import pytest

from sglite.runtime.reasoning import StreamingReasoningParser, get_reasoning_format

CASES = [
    # (format, output, reasoning, answer)
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHi!", "The user greets me.\n", "Hi!"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", "<think>\nStill thinking when cut", "Still thinking when cut", ""),
    ("deepseek-r1", "Let me add: 2 + 2 = 4.\n</think>\n\n4", "Let me add: 2 + 2 = 4.\n", "4"),
    ("deepseek-r1", "<think>Opened again.</think>Done.", "Opened again.", "Done."),
    ("qwen3", "<thin>k is not a tag", None, "<thin>k is not a tag"),
]


@pytest.mark.parametrize("name, text, reasoning, answer", CASES)
def test_whole_outputs_split(name, text, reasoning, answer):
    assert get_reasoning_format(name).split(text) == (reasoning, answer)


@pytest.mark.parametrize("name, text, reasoning, answer", CASES)
def test_streams_split_anywhere_send_the_same_reasoning(name, text, reasoning, answer):
    fmt = get_reasoning_format(name)
    for cut in range(len(text) + 1):
        parser = StreamingReasoningParser(fmt)
        first, partial_answer = parser.update(text[:cut])
        assert "<think>"[:2] not in first and "</" not in first
        assert answer.startswith(partial_answer)
        last, final_answer = parser.update(text, final=True)
        assert first + last == (reasoning or ""), cut
        assert final_answer == answer


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        get_reasoning_format("o1")
