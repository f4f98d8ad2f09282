"""One request's index of its n-grams, for prompt-lookup drafts (`ngram.NgramProposer`).

Invariant: `ends[n][gram]` is the end (exclusive) of the latest occurrence of the n-gram `gram`
among the request's tokens below `indexed`, for every n between the index's min and max match
windows; the request's last token is never an indexed end, so a suffix match finds an earlier
occurrence, not itself. Indexing is incremental: a lookup costs a few dictionary reads however
long the request is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SuffixIndex:
    """Where each n-gram of a request's tokens last ended."""

    min_match: int
    max_match: int
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # positions below this are indexed as n-gram ends

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram ending before the last of `tokens` (the request's tokens now)."""
        last = len(tokens) - 1
        for end in range(max(self.indexed, 1), last + 1):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self.ends.setdefault(n, {})[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, last + 1)

    def match(
        self, tokens: list[int], low: int, high: int, originals: dict[int, int]
    ) -> int | None:
        """Where what followed the latest earlier occurrence of the longest suffix of `low` to
        `high` tokens starts (the suffix as written, or with `originals`' tokens read as the
        ones they replaced), or None."""
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            ends = self.ends.get(n, {})
            suffix = tuple(tokens[-n:])
            end = ends.get(suffix)
            if end is None and originals:
                end = ends.get(tuple(originals.get(t, t) for t in suffix))
            if end is not None:
                return end
        return None
