"""Speculative decoding: what every draft source shares.

A `Speculator` proposes a request's draft for the next decode step (the scheduler verifies it
with `drafts.DraftVerifier`), learns how much of it was accepted, and forgets finished requests.
Two sources exist: n-gram lookup in the radix cache and the request's own text (`ngram.py`)
and a draft model (`draft_model.py`); with a draft model, n-gram matches come first where they
likely gain as much as the draft model's next draft (`speculators.NgramBeforeDraft`). Each
keeps, per request, a copy of its tokens extended by the new ones (`TokenHistory`) and a draft
length adapted to its acceptance (`DraftLength`), and the scheduler measures each source's
cost (`speculation_costs.SpeculationCosts`).
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


# A kind of draft (an n-gram kind, a draft model) keeps an accepted share that starts at
# KIND_PRIOR (accepted, drafted tokens) and whose counts decay by KIND_DECAY per verification
# of that kind, so the share follows the workload. A draft model that does not pay is still
# drafted once in KIND_PROBE_EVERY steps with a proposal that would take it, a gap that doubles
# with every probe that leaves it below, up to KIND_PROBE_MAX (every probe verifies rows that
# cannot pay); an n-gram kind learns from its drafts that were not verified instead
# (`KindAcceptance.checked`), which cost nothing.
KIND_PRIOR = (2.0, 4.0)
KIND_DECAY = 0.97
KIND_PROBE_EVERY = 8
KIND_PROBE_MAX = 256
# A kind's recent tokens (decayed) below which their accepted share is too little evidence to
# choose between draft sources by (`NgramBeforeDraft`).
MIN_EVIDENCE_TOKENS = 16
# A request's own drafts are judged with the kind's recent ones (all requests) counted as at
# most this many tokens at their share and cost (`KindAcceptance.covers_cost_for`): its first
# drafts follow what the workload's did, its own text outweighs that after a few drafts.
REQUEST_PRIOR_TOKENS = 8.0


@dataclass
class DraftTally:
    """Recent verifications of some drafts (one request's own: `DraftSequence.drafts`; a kind's
    over all requests: `KindAcceptance`), decayed by KIND_DECAY each: tokens drafted and
    accepted, and what their cost was worth in tokens (each verification's drafted tokens
    times its step's break-even share)."""

    accepted: float = 0.0
    drafted: float = 0.0
    cost: float = 0.0

    def record(self, drafted: int, accepted: int, needed: float) -> None:
        """A verification kept `accepted` of `drafted` tokens, in a step whose drafts paid
        above a share of `needed` (`BreakEvens.needed`)."""
        self.accepted = self.accepted * KIND_DECAY + accepted
        self.drafted = self.drafted * KIND_DECAY + drafted
        self.cost = self.cost * KIND_DECAY + drafted * needed


@dataclass
class KindAcceptance(DraftTally):
    """One kind of draft's recent verifications (all requests: a kind's quality is the
    workload's), decayed by KIND_DECAY each: its tokens drafted and accepted, and the tokens
    their cost was worth (each verification's drafted tokens times its step's break-even
    share, the fixed part of a verification included); and whether it pays, by one of two
    rules: its share against a given break-even (`pays`: n-gram kinds, against a long draft's,
    their short drafts being the draft length's to stop), or its drafts as made against their
    cost (`covers_cost`: the draft model, whose first pass and confident long drafts count
    alike). Starts at KIND_PRIOR's share, costed at LOW_ACCEPTANCE."""

    accepted: float = KIND_PRIOR[0]
    drafted: float = KIND_PRIOR[1]
    cost: float = KIND_PRIOR[1] * LOW_ACCEPTANCE  # in tokens
    total_drafted: int = 0
    total_accepted: int = 0
    total_checked: int = 0  # tokens of unverified drafts checked (`checked`)
    total_checked_kept: int = 0
    refused: int = 0  # steps with a proposal refused since the last probe
    asked_at: int = -1  # the step of the latest proposal refused
    probe_gap: int = KIND_PROBE_EVERY

    def record(self, drafted: int, accepted: int, needed: float) -> None:
        """`DraftTally.record`, counted in the totals too."""
        super().record(drafted, accepted, needed)
        self.total_drafted += drafted
        self.total_accepted += accepted

    def checked(self, drafted: int, accepted: int, needed: float) -> None:
        """A draft of this kind that was not verified kept `accepted` of `drafted` tokens, as
        checked against the tokens the model then wrote (an n-gram draft: `OwnDrafts`):
        counted in the recent share as a verification would be, and in the checked totals."""
        super().record(drafted, accepted, needed)
        self.total_checked += drafted
        self.total_checked_kept += accepted

    def pays(self, needed: float) -> bool:
        """Whether its recent share is above `needed`."""
        return self.accepted > needed * self.drafted

    @property
    def share(self) -> float:
        """The recent drafts' accepted share of their tokens."""
        return self.accepted / self.drafted

    @property
    def expected_share(self) -> float:
        """The share of its next draft's tokens likely kept: the recent share, or 1 while its
        recent tokens are too few to tell (MIN_EVIDENCE_TOKENS): drafting is how it learns."""
        return self.share if self.drafted >= MIN_EVIDENCE_TOKENS else 1.0

    def age(self) -> None:
        """Decay its counts as a verification of nothing would: the same share, on less
        evidence."""
        self.accepted *= KIND_DECAY
        self.drafted *= KIND_DECAY
        self.cost *= KIND_DECAY

    def pays_for(self, own: DraftTally | None, needed: float) -> bool:
        """`pays` for one request: its own recent drafts (`own`) with this kind's counted as
        at most REQUEST_PRIOR_TOKENS tokens; the kind's alone while it has none."""
        if own is None or own.drafted <= 0.0:
            return self.pays(needed)
        weight = self._prior_weight()
        drafted = self.drafted * weight + own.drafted
        return self.accepted * weight + own.accepted > needed * drafted

    def covers_cost(self) -> bool:
        """Whether its recent drafts got more tokens accepted than their cost was worth."""
        return self.accepted > self.cost

    def covers_cost_for(self, own: DraftTally) -> bool:
        """`covers_cost` for one request: its own recent drafts (`own`) with this kind's counted
        as at most REQUEST_PRIOR_TOKENS tokens (a request whose text the drafts do not fit stops
        after a few, though the workload's drafts before it paid; one they fit goes on though
        they did not)."""
        weight = self._prior_weight()
        return self.accepted * weight + own.accepted > self.cost * weight + own.cost

    def expected_share_for(self, own: DraftTally) -> float:
        """`expected_share` for one request: its own recent share with this kind's counted as at
        most REQUEST_PRIOR_TOKENS tokens; the kind's alone while the request drafted nothing."""
        if own.drafted <= 0.0:
            return self.expected_share
        weight = self._prior_weight()
        return (self.accepted * weight + own.accepted) / (self.drafted * weight + own.drafted)

    def unknown_for(self, own: DraftTally) -> bool:
        """Whether neither this kind's tokens ever verified nor the request's own recent ones
        (`own`) reach MIN_EVIDENCE_TOKENS: a fresh server's first drafts (the kind's count is
        not decayed, so a tally aged while other drafts were preferred stays judged). There a
        draft model drafts to learn: the prior's share and one draft (2 of 4 kept) would stop
        a request's drafts for good, and a draft not made teaches nothing."""
        return self.total_drafted < MIN_EVIDENCE_TOKENS and own.drafted < MIN_EVIDENCE_TOKENS

    def _prior_weight(self) -> float:
        """The factor that scales this kind's recent counts to REQUEST_PRIOR_TOKENS tokens."""
        return min(1.0, REQUEST_PRIOR_TOKENS / max(self.drafted, 1e-9))

    def admit(self, paying: bool, step: int, cheap: bool = True) -> bool:
        """Whether to draft now (in the proposer's `step`), given whether drafts pay (`pays`,
        possibly with other conditions): always while they do, else once per probe gap of
        steps with a proposal refused (a batch's requests share a step: every probe adds rows
        to a batch's verification), at the first proposal past the gap where a probe is
        `cheap` (a draft model in step with the request)."""
        if paying:
            self.refused, self.probe_gap = 0, KIND_PROBE_EVERY
            return True
        if step != self.asked_at:
            self.asked_at = step
            self.refused += 1
        if self.refused < self.probe_gap or not cheap:
            return False
        self.refused, self.probe_gap = 0, min(2 * self.probe_gap, KIND_PROBE_MAX)
        return True

    @property
    def probe_due(self) -> bool:
        """Whether the next step's proposals `admit` is asked about, while drafts do not pay,
        may probe."""
        return self.refused + 1 >= self.probe_gap

    def info(self) -> dict[str, float]:
        """Tokens drafted and accepted in all, the recent share, and the recent drafts' cost
        as a share of their tokens (their break-even as made)."""
        return {
            "drafted": self.total_drafted,
            "accepted": self.total_accepted,
            "checked": self.total_checked,
            "checked_kept": self.total_checked_kept,
            "recent_acceptance": self.share,
            "recent_break_even": self.cost / self.drafted,
        }


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
