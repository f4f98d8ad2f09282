"""N-gram (prompt lookup) speculation: drafts copied from the request's own text.

Where a request is repeating or quoting what it has seen (editing code, quoting a passage,
filling a record from a document), the tokens that followed the last earlier occurrence of its
latest n tokens are a good guess for what comes next. `NgramProposer` proposes them as a draft
that `drafts.DraftVerifier` checks in the next forward; every emitted token is still the model's
own sample, so outputs follow token-by-token decoding exactly (see drafts.py).

Per request the proposer keeps an index from each n-gram (n between the min and max match
windows) to where its latest occurrence ended, built incrementally as tokens are added, so a
proposal costs a few dictionary lookups however long the request is. The draft length adapts
to the request's acceptance: it grows while whole drafts are accepted, shrinks to just past
what was accepted, and speculation pauses for a request whose drafts are mostly rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglite.runtime.scheduler.request import Req

# A request whose acceptance falls below this share (over at least PAUSE_AFTER drafted
# tokens) stops drafting for PAUSE_STEPS proposals: verification rows cost compute.
LOW_ACCEPTANCE = 0.2
PAUSE_AFTER = 16
PAUSE_STEPS = 16


@dataclass
class NgramState:
    """One request's n-gram index and draft-length state."""

    # ends[n][ngram] = the end (exclusive) of the ngram's latest indexed occurrence.
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    # The request's prompt and output so far, extended by the new tokens only (building
    # `req.fill_ids` every step would copy the whole sequence on the decode path).
    tokens: list[int] = field(default_factory=list)
    indexed: int = 0  # positions below this are indexed as n-gram ends
    draft_len: int = 0
    drafted: int = 0  # over the current acceptance window
    accepted: int = 0
    paused: int = 0  # proposals left to skip


class NgramProposer:
    """Drafts from the request's prompt and output (`DraftProposer`)."""

    def __init__(
        self, context_len: int, num_draft_tokens: int, min_match: int, max_match: int
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"n-gram match windows must satisfy 1 <= {min_match} <= {max_match}")
        self.context_len = context_len
        self.num_draft_tokens = num_draft_tokens
        self.min_match = min_match
        self.max_match = max_match
        self.states: dict[str, NgramState] = {}

    def propose(self, req: Req) -> list[int]:
        """Up to the request's draft length of tokens that followed the longest (from
        `max_match` down to `min_match` tokens) earlier match of its current suffix; the
        `DraftProposer` bound holds."""
        state = self.states.get(req.rid)
        if state is None:
            state = self.states[req.rid] = NgramState(draft_len=self.num_draft_tokens)
        if state.paused:
            state.paused -= 1
            return []
        room = min(req.remaining_new_tokens, self.context_len - req.num_fill) - 1
        if room <= 0:
            return []
        tokens = self._sync(state, req)
        self._index(state, tokens)
        for n in range(min(self.max_match, len(tokens) - 1), self.min_match - 1, -1):
            end = state.ends.get(n, {}).get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + min(room, state.draft_len)]
        return []

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """Adapt the request's draft length to a verification's result."""
        state = self.states.get(req.rid)
        if state is None or drafted == 0:
            return
        if accepted == drafted:
            state.draft_len = min(self.num_draft_tokens, state.draft_len * 2)
        else:
            state.draft_len = max(1, accepted + 1)
        state.drafted += drafted
        state.accepted += accepted
        if state.drafted >= PAUSE_AFTER:
            if state.accepted < LOW_ACCEPTANCE * state.drafted:
                state.paused = PAUSE_STEPS
                state.draft_len = self.num_draft_tokens
            state.drafted = state.accepted = 0

    def forget(self, live: set[str]) -> None:
        """Drop the state of requests not in `live` (finished or aborted ones)."""
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]

    @staticmethod
    def _sync(state: NgramState, req: Req) -> list[int]:
        """`state.tokens` brought up to `req.fill_ids` by copying what is new."""
        if not state.tokens:
            state.tokens = list(req.prompt_ids)
        state.tokens.extend(req.output_ids[len(state.tokens) - len(req.prompt_ids) :])
        return state.tokens

    def _index(self, state: NgramState, tokens: list[int]) -> None:
        """Index every n-gram ending before the last token (the suffix being matched must find
        an earlier occurrence, not itself)."""
        last = len(tokens) - 1
        for end in range(max(state.indexed, 1), last + 1):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                state.ends.setdefault(n, {})[tuple(tokens[end - n : end])] = end
        state.indexed = max(state.indexed, last + 1)
