"""Speculative decoding: what every draft source shares.

A `Speculator` proposes a request's draft for the next decode step (the scheduler verifies it
with `drafts.DraftVerifier`), learns how much of it was accepted, and forgets finished requests.
Two sources exist: n-gram lookup in the radix cache and the request's own text (`ngram.py`)
and a draft model (`draft_model.py`); with a draft model, n-gram matches come first where they
likely gain as much as the draft model's next draft (`speculators.NgramBeforeDraft`). Each
keeps, per request, a copy of its tokens extended by the new ones (`TokenHistory`) and a draft
length adapted to its acceptance (`DraftLength`), and per kind of draft what it has earned
(`draft_tally.KindAcceptance`); the scheduler measures each source's cost
(`speculation_costs.SpeculationCosts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sglite.runtime.scheduler.request import Req

# A request whose acceptance falls below this share, or below the measured break-even
# (`SpeculationCosts`), over at least PAUSE_AFTER drafted tokens stops drafting for PAUSE_STEPS
# proposals: verification rows cost compute.
LOW_ACCEPTANCE = 0.2
PAUSE_AFTER = 16
PAUSE_STEPS = 16
# Consecutive pauses double, up to PAUSE_STEPS << (MAX_BACKOFF - 1) proposals: drafts that keep
# failing (or a draft model that cannot pay at any acceptance) are tried less and less often.
MAX_BACKOFF = 4


# For how many of a step's requests a draft source (a `Proposal.source`) may propose: 0 for
# none, EVERY_REQUEST for all (`SpeculationCosts.drafting_requests`, from its measured costs).
SourceFilter = Callable[[str], int]
EVERY_REQUEST = 1 << 30
# The draft sources' names.
NGRAM_SOURCE = "ngram"
DRAFT_MODEL_SOURCE = "draft"


@dataclass(frozen=True)
class Proposal:
    """A speculative draft and the source that proposed it ("ngram", "draft"): the source whose
    costs (`SpeculationCosts`) and acceptance (`DraftLength`) it counts toward. `share`: the
    share of its tokens its source expects accepted, by which the step decides whether the
    draft is worth verifying (`SpeculationCosts.worth_verifying`); None for a draft verified
    whatever the step costs (a probe, a draft model's, whose passes are spent)."""

    tokens: list[int]
    source: str
    share: float | None = None


@dataclass(frozen=True)
class BreakEvens:
    """The accepted shares at which a step's drafts pay (`SpeculationCosts.break_evens`):
    drafts of the step's length above `needed`, the longest ones above `least` (the
    verification's fixed cost spread to nothing); `saved_seconds`, what an accepted token
    saves in the step's batch (None until measured), prices a draft model's passes."""

    needed: float
    least: float
    saved_seconds: float | None = None

    @classmethod
    def uniform(cls, share: float = LOW_ACCEPTANCE) -> BreakEvens:
        """The same share for every length (`LOW_ACCEPTANCE` while nothing is measured)."""
        return cls(share, share)


def proposals_from(
    source: str,
    propose_many: Callable[[list[Req]], dict[str, list[int]]],
    reqs: list[Req],
    allowed: SourceFilter,
    share_of: Callable[[str], float | None] = lambda rid: None,
) -> dict[str, Proposal]:
    """One source's `Speculator.speculate`: `propose_many(reqs)`'s non-empty drafts as
    `source`'s, each with `share_of` its request (asked after the drafts are made:
    `Proposal.share`); where `allowed` lets it draft for fewer requests than `reqs`, the
    requests are asked one by one until that many have a draft (the first requests may have
    none: a source measured on one request's draft is not kept waiting by one it cannot
    draft for)."""
    limit = allowed(source)
    if not reqs or limit <= 0:
        return {}
    if limit >= len(reqs):
        drafts = propose_many(reqs)
    else:
        drafts = {}
        for req in reqs:
            drafts.update((rid, t) for rid, t in propose_many([req]).items() if t)
            if len(drafts) >= limit:
                break
    return {
        rid: Proposal(tokens, source, share_of(rid)) for rid, tokens in drafts.items() if tokens
    }


class Speculator(Protocol):
    """A speculative draft source (a `drafts.DraftProposer` that learns from verification)."""

    def speculate(self, reqs: list[Req], allowed: SourceFilter) -> dict[str, Proposal]:
        """Drafts (by request id) for those of `reqs` that get one, from sources `allowed`
        takes (each for at most as many requests as it allows), each within the
        `DraftProposer.propose` bound."""
        ...

    def price(self, prices: Callable[[str], BreakEvens]) -> None:
        """The break-evens of this step's drafts by source (`prices(source)`: its batch size's
        measured costs), before it proposes: the batch size changes between steps, and a
        source priced only by its latest verification would judge a batch of four by a lone
        request's costs until its own drafts are verified there."""
        ...

    def record(self, req: Req, drafted: int, accepted: int, shares: BreakEvens) -> None:
        """A verification of `req`'s draft kept `accepted` of its `drafted` tokens; `shares`:
        the acceptances at which the step's drafts pay."""
        ...

    def read_prompt(self, req: Req) -> None:
        """Read the prompt of `req`, just prefilled by the target and about to decode, ahead of
        its first draft (a draft model's pass over it, as the target's prefill; nothing for
        n-gram lookups)."""
        ...

    def forget(self, live: set[str]) -> None:
        """Release what is kept for requests not in `live` (finished, aborted, retracted)."""
        ...

    def flush(self) -> None:
        """Drop what is cached across requests (the server's cache flush)."""
        ...

    def take_prompt_seconds(self) -> float:
        """Seconds spent since the last call reading new requests' prompts in a decode step
        (a draft model's catch-up on a prompt `read_prompt` did not read: once per request, not
        per draft), which the step's measured cost leaves out; resets the count."""
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError when the speculator's own KV accounting is broken."""
        ...

    def info(self) -> dict[str, Any]:
        """What get_server_info reports of the speculator."""
        ...


# A request's first draft, and its first after a pause, is about this long (`VerifyRows.first`):
# a long draft that is rejected costs a long verification (most rows when the text does not
# copy), and one that is accepted grows at once.
FIRST_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class VerifyRows:
    """How the target's kernels price a draft's verification rows (its tokens and the model's
    own next one), by which drafts are sized: `group` rows cost about as one where the int8
    GEMV takes x rows in groups and no GEMM takes more (`weight_policy.verification_row_group`:
    AVX2 builds, where a fifth row decodes every weight block again), 1 where each further row
    costs about alike (a GEMM takes larger batches: VNNI-512, AMX). Decided at load."""

    group: int = 1

    def first(self, maximum: int) -> int:
        """A first draft's length (at most `maximum`): FIRST_DRAFT_TOKENS, cut to whole groups
        of rows (3 tokens in groups of four)."""
        rows = FIRST_DRAFT_TOKENS + 1
        return max(1, min(maximum, rows - rows % self.group - 1))

    def grown(self, length: int, maximum: int) -> int:
        """The next length of a draft of `length` tokens accepted whole (at most `maximum`):
        twice as long (`scaled`: in groups 3, 7, 15, 31 tokens, whole groups of four as a
        first draft's; else 4, 8, 16)."""
        return min(maximum, self.scaled(length, 2))

    def scaled(self, length: int, times: int) -> int:
        """A draft `times` as long as one of `length` tokens: in groups, its rows `times` as
        many (whole groups stay whole)."""
        return times * (length + 1) - 1 if self.group > 1 else times * length


# Drafts sized where every verification row costs about alike (the default of the classes that
# take a `VerifyRows`).
UNGROUPED_ROWS = VerifyRows()


@dataclass
class DraftLength:
    """One request's draft length: it starts at `rows.first` (at most `maximum`), grows from
    a draft accepted whole (`rows.grown` of its length), shrinks to just past what was
    accepted, and, where it `pauses`, drafting pauses for a while when most of a window's
    drafts are rejected (a source that judges its requests by tallies of its own, as the draft
    model does, sizes drafts here and nothing more: a window's verdict rests on its last few
    drafts, where one long draft missed at its first token outweighs a run of kept ones)."""

    maximum: int
    rows: VerifyRows = UNGROUPED_ROWS
    pauses: bool = True
    current: int = 0
    drafted: int = 0  # over the current acceptance window
    accepted: int = 0
    needed: float = 0.0  # accepted tokens the window's drafts needed to pay for themselves
    paused: int = 0  # proposals left to skip
    backoff: int = 0  # consecutive pauses

    def __post_init__(self) -> None:
        self.current = self.current or self.start

    @property
    def start(self) -> int:
        """The length of a first draft, and of the first after a pause."""
        return self.rows.first(self.maximum)

    def next(self, room: int) -> int:
        """Tokens to draft now (0 while paused), at most `room`."""
        if self.paused:
            self.paused -= 1
            return 0
        return max(0, min(room, self.current))

    def shown(self, tokens: int) -> None:
        """A draft of `tokens` would have been kept whole where another source's draft was
        verified instead (the target wrote those tokens): the length grows as if it had been,
        so that a source passed over on a copy is not held to its first short drafts."""
        self.current = max(self.current, self.rows.grown(tokens, self.maximum))

    def record(self, drafted: int, accepted: int, shares: BreakEvens) -> None:
        """Adapt to a verification's result; drafting pauses when the tokens accepted over the
        window are fewer than its drafts needed to pay (each draft's `shares.needed`, from
        `SpeculationCosts.break_even`) or than a `LOW_ACCEPTANCE` share. Where no draft can
        pay however long (`shares.least` of 1 or more), the longest pause comes at once; a
        short draft whose own break-even is above 1 (a verification's fixed cost spread over
        few tokens) is judged with the window's others instead."""
        if drafted == 0:
            return
        if accepted == drafted:
            # grown from what was shown: a short match kept whole says little of a long draft
            self.current = self.rows.grown(drafted, self.maximum)
        else:
            self.current = max(1, accepted + 1)
        if not self.pauses:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.needed += max(shares.needed, LOW_ACCEPTANCE) * drafted
        hopeless = shares.least >= 1.0
        if self.drafted >= PAUSE_AFTER or hopeless:
            if self.accepted < self.needed:
                grown = MAX_BACKOFF if hopeless else self.backoff + 1
                self.backoff = min(grown, MAX_BACKOFF)
                self.paused = PAUSE_STEPS << (self.backoff - 1)
                self.current = self.start
            else:
                self.backoff = 0
            self.drafted = self.accepted = 0
            self.needed = 0.0


@dataclass
class TokenHistory:
    """A request's prompt and output so far, extended by the new tokens only (building
    `req.fill_ids` every step would copy the whole sequence on the decode path)."""

    tokens: list[int] = field(default_factory=list)

    def sync(self, req: Req) -> list[int]:
        """The tokens, brought up to the request's prompt and output."""
        if not self.tokens:
            self.tokens = list(req.prompt_ids)
        self.tokens.extend(req.output_ids[len(self.tokens) - len(req.prompt_ids) :])
        return self.tokens


def draft_room(req: Req, context_len: int) -> int:
    """Most draft tokens `req` can take: the draft plus the model's own next token fit in its
    budget and context."""
    return min(req.remaining_new_tokens, context_len - req.num_fill) - 1
