"""What a kind of draft has earned: its recent verifications' accepted share and cost.

A `DraftTally` holds recent verifications of some drafts (one request's own), decayed by
KIND_DECAY each; a `KindAcceptance` holds a kind's over all requests (an n-gram kind, a draft
model), judges whether it pays (against a break-even, or its drafts against their cost), with
a request's own tally weighed against it, and spaces the probes of a kind that does not pay.
The speculators (`ngram.py`, `draft_model.py`) keep one per kind and ask it before drafting.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglite.runtime.scheduler.speculation import LOW_ACCEPTANCE

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
