"""Incremental detokenization and stop-string matching for streaming output.

`IncrementalDetokenizer` turns generated ids into text one step at a time. Decoding a single
token on its own is wrong in two ways: byte-level BPE and SentencePiece byte-fallback split one
UTF-8 character over several tokens (alone they decode to U+FFFD), and SentencePiece drops the
leading space of the first token it decodes. So each push decodes a short window — a few tokens
already emitted (the prefix) plus the new ones — and emits the difference between that and the
prefix alone (the prefix_offset/read_offset technique). Text ending in U+FFFD is held back until
the character completes. The window never grows with the output, so a push costs O(1).

`StopChecker` finds stop strings and stop regexes in the cumulative text, looking only at the
part that could involve the newly added text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context for the first output tokens (SentencePiece leading space).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, hence at most 4 byte tokens; if more tokens than this
# are pending and the text still ends in U+FFFD, it is a genuine replacement character (invalid
# bytes from the model) and is emitted, so a pathological output cannot grow the window forever.
MAX_PENDING_TOKENS = 8
# Stop regexes are searched in at most this many characters before the new text; a match must
# overlap the new text, and stop patterns are short, so this bounds the cost per step.
STOP_REGEX_LOOKBACK = 1024


class SupportsDecode(Protocol):
    """Anything with a transformers-like `decode` (a HF tokenizer, sglite's Tokenizer)."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        """Text of `ids`."""
        ...


class IncrementalDetokenizer:
    """Streams the text of generated token ids; `push` returns only the new text."""

    def __init__(
        self,
        tokenizer: SupportsDecode,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """`prompt_ids` (optional) gives left context so the first output token keeps its
        leading space under SentencePiece; without it, the concatenated output equals
        `tokenizer.decode(output_ids)` exactly."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids: list[int] = context
        # ids[prefix:read] were emitted already and give context; ids[read:] are pending.
        self._prefix = 0
        self._read = len(context)
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._num_context = len(context)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every push/flush result)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    @property
    def output_ids(self) -> list[int]:
        """Every id pushed so far (prompt context excluded)."""
        return self._ids[self._num_context :]

    def push(self, ids: list[int]) -> str:
        """Add generated ids; return the text they complete (may be "" while a character is
        incomplete)."""
        self._ids.extend(ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """Emit whatever is held back (at the end of generation), even if incomplete."""
        return self._advance(force=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    @staticmethod
    def _complete(text: str, prefix_text: str) -> bool:
        # U+FFFD at the end is (usually) a character whose remaining bytes are still to come;
        # no growth means the new tokens decode to nothing yet (e.g. skipped special tokens).
        return not text.endswith(REPLACEMENT_CHAR) and len(text) > len(prefix_text)

    def _advance(self, force: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        end = len(self._ids)
        if not force and not self._complete(full_text, prefix_text):
            if end - self._read <= MAX_PENDING_TOKENS:
                return ""
            # Many tokens pending (several pushed at once, or invalid bytes): emit up to the
            # last point where the text is complete, which is at most 3 tokens back (a UTF-8
            # character has at most 4 bytes); failing that the bytes are invalid, emit them.
            for back in (1, 2, 3):
                shorter = self._decode(self._ids[self._prefix : end - back])
                if self._complete(shorter, prefix_text):
                    full_text, end = shorter, end - back
                    break
        # The prefix decodes the same inside the longer window (tokens before it are fixed), so
        # what follows its length is exactly the new text.
        new_text = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, end
        if new_text:
            self._chunks.append(new_text)
            self._text_cache = None
        return new_text


@dataclass
class StopMatch:
    """A stop string or stop regex found in the output text."""

    matched: str  # the stop string, or the regex pattern
    cut: int  # the output is text[:cut] (the stop text itself excluded)
    end: int  # index just past the match (text[cut:end] is the matched text)
    is_regex: bool = False


class StopChecker:
    """Finds the earliest stop string / stop regex match that involves newly added text."""

    def __init__(self, stop: list[str] | None = None, stop_regex: list[str] | None = None):
        self.stop = [s for s in (stop or []) if s]
        self.patterns = [re.compile(p) for p in (stop_regex or [])]
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def __bool__(self) -> bool:
        return bool(self.stop or self.patterns)

    def check(self, text: str, new_from: int) -> StopMatch | None:
        """The earliest match in `text` that ends after `new_from` (where this step's text
        starts), or None. A stop string may straddle earlier and new text."""
        if new_from >= len(text) or not self:
            return None
        best: StopMatch | None = None
        for s in self.stop:
            # Only occurrences ending inside the new text are new; earlier ones were checked.
            idx = text.find(s, max(0, new_from - len(s) + 1))
            if idx >= 0 and (best is None or (idx, idx + len(s)) < (best.cut, best.end)):
                best = StopMatch(matched=s, cut=idx, end=idx + len(s))
        if self.patterns:
            start = max(0, new_from - STOP_REGEX_LOOKBACK)
            for pattern in self.patterns:
                for m in pattern.finditer(text, start):
                    if m.end() <= new_from or m.end() == m.start():
                        continue
                    if best is None or (m.start(), m.end()) < (best.cut, best.end):
                        best = StopMatch(pattern.pattern, m.start(), m.end(), is_regex=True)
                    break
        return best

    def partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string.

        A streaming server holds that many trailing characters back: they may yet turn out to
        be the start of a stop string that will be trimmed. (Regexes are not considered.)
        """
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
