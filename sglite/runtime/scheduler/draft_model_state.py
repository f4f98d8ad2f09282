"""The draft model's state per request and across requests (`draft_model.py` uses it).

`DraftSequence` holds one request's K/V in the draft model's pool, `GrowingDraft` a draft while
`DraftModelProposer.propose_many` grows it, `ConfidenceCalibration` how far the draft
model's probabilities predict the target's agreement, and `DraftPassCost` what a pass of the
draft model costs each token it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglite.runtime.cache.tree_node import TreeNode
from sglite.runtime.scheduler.draft_tally import KIND_DECAY, DraftTally
from sglite.runtime.scheduler.draft_vocabulary import RequestRows
from sglite.runtime.scheduler.request import SlotMirror
from sglite.runtime.scheduler.speculation import (
    FIRST_DRAFT_TOKENS,
    LOW_ACCEPTANCE,
    DraftLength,
    TokenHistory,
)
from sglite.runtime.scheduler.speculation_costs import smooth


@dataclass
class DraftSequence:
    """The draft model's K/V of one request: `slots[i]` holds that of `tokens[i]`.

    Invariants: `tokens[:verified]` are the request's own tokens (prompt and output); any
    tokens after them are the last draft's, not yet checked. `slots[:cached_len]` belong to the
    draft cache and are locked through `node`; the rest belong to this sequence. `slots`
    changes only by appending, by cutting its tail, each cut told to `slot_mirror` (its
    tensor copy for decode batches), and by being replaced by a new list when its prefix
    moves into the cache (`DraftKV.share`; the mirror copies a new list afresh).
    """

    length: DraftLength
    node: TreeNode
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    cached_len: int = 0
    verified: int = 0
    history: TokenHistory = field(default_factory=TokenHistory)
    extra: RequestRows | None = None  # its candidates past the draft vocabulary's prefix
    probabilities: list[float] = field(default_factory=list)  # the last draft's tokens'
    drafts: DraftTally = field(default_factory=DraftTally)  # its own drafts' fate
    slot_mirror: SlotMirror = field(default_factory=SlotMirror)

    def held(self, target: list[int]) -> int:
        """How many of `target`'s tokens (the request's) it holds: its longest prefix that is
        in `target`."""
        keep = min(self.verified, len(self.tokens))
        end = min(len(self.tokens), len(target))
        while keep < end and self.tokens[keep] == target[keep]:
            keep += 1
        return keep

    def cut(self, keep: int) -> None:
        """Drop the tokens and slots past the first `keep` (their slots freed by the caller)."""
        del self.tokens[keep:], self.slots[keep:]
        self.slot_mirror.truncate(keep)


# The calibration of the draft model's probabilities starts at CALIBRATION_PRIOR (accepted
# tokens, their summed probabilities) and decays by KIND_DECAY per verification, as a kind's
# acceptance does.
CALIBRATION_PRIOR = (2.0, 2.0)


@dataclass
class GrowingDraft:
    """A draft growing in `DraftModelProposer.propose_many`: the tokens so far, the tokens the
    next pass feeds its sequence, and the chance that the target keeps the whole draft."""

    rid: str
    seq: DraftSequence
    length: int
    feed: list[int]
    reads_prompt: bool
    probe: bool = False  # drafted while drafts for its request do not pay
    tokens: list[int] = field(default_factory=list)
    whole: float = 1.0


@dataclass
class ConfidenceCalibration:
    """The target's agreement with draft tokens per unit of the draft model's probability of
    them, over the recent verifications of all requests (a token counts when every token
    before it in its draft was accepted): a draft model sure of tokens the target rejects is
    scaled down; one that agrees with the target more than its probabilities say (the target
    itself, drafting with flat probabilities) up, to certainty at most."""

    accepted: float = CALIBRATION_PRIOR[0]
    predicted: float = CALIBRATION_PRIOR[1]

    def record(self, probabilities: list[float], accepted: int) -> None:
        """A verification kept the first `accepted` tokens of a draft whose tokens the draft
        model gave these probabilities."""
        judged = probabilities[: accepted + 1]  # the first rejected token's too
        self.accepted = self.accepted * KIND_DECAY + accepted
        self.predicted = self.predicted * KIND_DECAY + sum(judged)

    @property
    def factor(self) -> float:
        """Tokens the target kept per unit of the draft model's probability of them."""
        return self.accepted / max(self.predicted, 1e-9)

    def agreement(self, probability: float) -> float:
        """The chance that the target keeps a token the draft model gave `probability`, given
        it kept every token before it."""
        return min(1.0, probability * self.factor)


# Tokens from which a pass's seconds per token price the draft model's catch-up on a request.
CATCH_UP_MEASURED = 8


@dataclass
class DraftPassCost:
    """What the draft model's passes cost the tokens they draft, smoothed over recent drafts:
    the seconds of a pass that grows drafts by one token each, and, per number of requests a
    proposal drafts for (about the decode batch), the passes its drafts took per token
    drafted (the first pass, which catches up on the target's new tokens, included).

    The measured cost of a drafted token (`SpeculationCosts`, per batch size: a verification
    row plus its share of the passes) holds the passes at that average share. A pass grows
    every request that still drafts at once for about one request's cost, so a pass that
    grows fewer drafts than usual costs each of its tokens more: `needed` prices the next
    token of a draft by how many drafts the pass would grow."""

    pass_seconds: float | None = None
    passes_per_token: dict[int, float] = field(default_factory=dict)  # by requests offered
    tokens_per_draft: float = FIRST_DRAFT_TOKENS  # of the drafts it made
    catch_up_seconds: float | None = None  # per token, in passes over many tokens

    def add_pass(self, seconds: float) -> None:
        """A pass that grew drafts by one token each took `seconds`."""
        self.pass_seconds = smooth(self.pass_seconds, seconds)

    def add_catch_up(self, seconds: float, tokens: int) -> None:
        """A pass over `tokens` of the requests' own tokens (a prompt, or the tokens emitted
        since a request's last draft) took `seconds`; counted from CATCH_UP_MEASURED tokens,
        where a pass's cost is mostly its tokens'."""
        if tokens >= CATCH_UP_MEASURED:
            self.catch_up_seconds = smooth(self.catch_up_seconds, seconds / tokens)

    def add_draft(self, offered: int, passes: int, tokens: int, drafts: int) -> None:
        """A proposal for `offered` requests ran `passes` passes for `tokens` drafted tokens in
        `drafts` drafts."""
        if tokens > 0:
            ratio = passes / tokens
            self.passes_per_token[offered] = smooth(self.passes_per_token.get(offered), ratio)
            self.tokens_per_draft = smooth(self.tokens_per_draft, tokens / drafts)

    def needed(
        self, least: float, saved_seconds: float | None, growing: int, offered: int
    ) -> float:
        """The chance of being kept that each next token of `growing` drafts needs for one
        more pass to pay, in a proposal for `offered` requests: `least` (a drafted token's
        measured cost over what an accepted one saves) with the passes' average share
        replaced by this pass's, split `growing` ways. `least` until the costs are measured."""
        per_token = self.passes_per_token.get(offered)
        if saved_seconds is None or self.pass_seconds is None or per_token is None:
            return least
        verification = max(least - self.pass_seconds * per_token / saved_seconds, 0.0)
        share = self.pass_seconds / (max(growing, 1) * saved_seconds)
        return max(verification + share, LOW_ACCEPTANCE)

    def worth_a_pass(
        self, drafts: list[GrowingDraft], least: float, saved_seconds: float | None, offered: int
    ) -> list[GrowingDraft]:
        """The drafts one more pass grows (in their order): the likeliest kept whole, as many
        as are likely enough to pay for their share of the pass (`needed`); none when even
        the likeliest is not. Past that, a next token would be kept too rarely to pay."""
        ranked = sorted(drafts, key=lambda d: d.whole, reverse=True)
        for count in range(len(ranked), 0, -1):
            if ranked[count - 1].whole >= self.needed(least, saved_seconds, count, offered):
                kept = {d.rid for d in ranked[:count]}
                return [d for d in drafts if d.rid in kept]
        return []
