"""A request's own evidence of how n-gram drafts fare on its text, per kind of draft.

A kind's record over all requests (`KindAcceptance`) says what the workload's drafts of that
kind were worth, but requests differ: after requests that edited code, a request repeating a
passage copies it whole, and one writing freely after a run of copies copies nothing. Each
request therefore keeps its own tallies (`OwnDrafts`): of its drafts that were verified, and of
those that were not (a kind whose record does not pay, a draft the step's costs passed over, one
a draft model's draft took the place of), checked against the tokens the model then wrote. An
n-gram draft costs a few lookups to propose, so what it would have kept is known without
verifying it; a greedy verification keeps exactly the tokens the model writes as drafted (with
sampling, the check is the stricter of the two).

How long a request's copy has run (`copied_run`: its latest tokens as they stand before the
draft's source position) also bounds the draft's length (`run_cap`): copies end, and the longer
one has run the longer it likely goes on, so a draft token far past what the copy has shown is
kept too rarely to pay where verification rows cost most of what a kept token saves (a batch
on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglite.runtime.scheduler.draft_tally import DraftTally


@dataclass(frozen=True)
class UnverifiedDraft:
    """A draft of `kind` proposed when the request was `at` tokens long, not verified."""

    kind: str
    tokens: list[int]
    at: int

    def kept(self, sequence: list[int]) -> int | None:
        """How many of its tokens the model wrote as drafted after it (`sequence`: the
        request's tokens now), as a verification would have kept them; None while too few
        tokens are written to tell."""
        written = sequence[self.at : self.at + len(self.tokens)]
        kept = 0
        for drafted, wrote in zip(self.tokens, written):
            if drafted != wrote:
                return kept
            kept += 1
        return kept if kept == len(self.tokens) else None


@dataclass(frozen=True)
class CheckedDraft:
    """An unverified draft of `kind` once checked: `kept` of its `drafted` tokens written as
    drafted."""

    kind: str
    drafted: int
    kept: int


@dataclass
class OwnDrafts:
    """One request's n-gram drafts, per kind (`tallies`): the verified ones and the unverified
    ones once checked. At most one unverified draft is checked at a time (`unverified`), the
    latest proposal (`proposed`) becoming one when the next proposal finds it was not
    verified."""

    tallies: dict[str, DraftTally] = field(default_factory=dict)
    unverified: UnverifiedDraft | None = None
    proposed: UnverifiedDraft | None = None

    def verified(self, kind: str, drafted: int, accepted: int, needed: float) -> None:
        """The latest proposal, of `kind`, was verified: it kept `accepted` of `drafted`. An
        unverified draft awaiting its tokens is dropped (the verification counts them)."""
        self.proposed = self.unverified = None
        self._count(kind, drafted, accepted, needed)

    def _count(self, kind: str, drafted: int, accepted: int, needed: float) -> None:
        self.tallies.setdefault(kind, DraftTally()).record(drafted, accepted, needed)

    def refused(self, draft: UnverifiedDraft) -> None:
        """A draft not verified (found but not proposed, or proposed and left out of its step):
        checked once the model writes its tokens, unless another is being checked (then
        dropped)."""
        if self.unverified is None and draft.tokens:
            self.unverified = draft

    def check(self, sequence: list[int], needed: float) -> CheckedDraft | None:
        """Check the unverified draft against the request's tokens now (`sequence`), a
        proposal since left unverified first; where the tokens tell, count it at `needed`
        (the share a long draft needs) and return it."""
        if self.proposed is not None:
            self.refused(self.proposed)
            self.proposed = None
        draft = self.unverified
        kept = None if draft is None else draft.kept(sequence)
        if draft is None or kept is None:
            return None
        self.unverified = None
        self._count(draft.kind, len(draft.tokens), kept, needed)
        return CheckedDraft(draft.kind, len(draft.tokens), kept)


def copied_run(sequence: list[int], start: int, substitutions: dict[int, int], longest: int) -> int:
    """How many of the request's latest tokens (`sequence`) are a copy of those just before
    `start` (its substitutions made), counted up to `longest`: how long the copy a draft from
    `start` continues has run."""
    run, end = 0, len(sequence)
    while run < min(start, longest):
        source = sequence[start - run - 1]
        if substitutions.get(source, source) != sequence[end - run - 1]:
            break
        run += 1
    return run


def run_cap(run: int, needed: float, maximum: int) -> int:
    """The longest draft (at most `maximum`) whose last token is likely kept at `needed` (the
    share at which a draft token pays for its verification row), where a copy that has run r
    tokens runs i more with probability (r + 1) / (r + 1 + i): copy lengths spread as a power
    law, so a copy that ran twice as long likely goes on twice as far."""
    if needed <= 0.0:
        return maximum
    return max(0, min(maximum, int((run + 1) * (1.0 - needed) / needed + 1e-9)))


def run_needed(length: int, needed: float) -> int:
    """A run long enough for `run_cap` to allow a draft of `length` (no longer run is worth
    measuring)."""
    if needed >= 1.0:
        return 0
    return int(length * needed / (1.0 - needed)) + 1
