"""What speculative drafts cost, measured per batch size: a plain decode step's seconds and the
seconds each draft source's drafts add to a step (`SpeculationCosts`), from which the acceptance
at which a draft pays follows (`break_even`). The decode step times its steps into it
(`DecodeManager`, with `--speculative-adaptive`); `DraftLength` and the sources' acceptance
judge drafts against its break-even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglite.runtime.scheduler.speculation import (
    DRAFT_MODEL_SOURCE,
    EVERY_REQUEST,
    LOW_ACCEPTANCE,
    NGRAM_SOURCE,
    BreakEvens,
    Proposal,
)

# Step costs: weight of the newest step in the moving averages, and how often a step runs
# without drafts to keep the plain cost current.
COST_SMOOTHING = 0.125
PLAIN_PROBE_EVERY = 64
# A batch size's first decode steps are plain, and its plain cost starts as their least: the
# first step at a batch size runs cold (its kernels' code and data not yet in cache), and a
# moment of interference only ever slows a step, so the least of a few is the step's cost
# where their first alone would stand for hundreds of steps.
PLAIN_WARMUP_STEPS = 3
# Below this variance of the draft lengths seen, a verification's fixed cost is not told apart
# from the cost per token (`DraftCostFit`).
MIN_DRAFT_LENGTH_VARIANCE = 0.5
# Where a source's drafts cannot pay at any acceptance, a step still tries them after
# HOPELESS_PROBE_FIRST steps, a gap that doubles with every probe up to HOPELESS_PROBE_MAX:
# one step slowed by interference (on a shared host) must not stop a source for a thousand
# steps, and one that truly cannot pay costs a probe ever more rarely (a probe
# costs a draft model its catch-up on every token since the last one).
HOPELESS_PROBE_FIRST = 16
HOPELESS_PROBE_MAX = 1024


@dataclass
class DraftCostFit:
    """The seconds drafts add to a step, fitted as `fixed + per_token * drafted` over smoothed
    moments of (drafted, extra seconds): a verification pass has a cost of its own (the rows'
    layout, a matmul kernel for more rows) besides one row per drafted token, so a short draft
    costs more per token than a long one."""

    drafted: float = 0.0  # smoothed means of d, d^2, extra and d * extra
    drafted_sq: float = 0.0
    extra: float = 0.0
    drafted_extra: float = 0.0
    seen: int = 0  # steps folded in

    def add(self, drafted: int, extra: float) -> None:
        """Fold in a step that drafted `drafted` tokens and took `extra` seconds more than a
        plain one: the plain mean of the first 1 / COST_SMOOTHING steps (so that a cold first
        one weighs no more than the others), a moving average after."""
        self.seen += 1
        weight = max(COST_SMOOTHING, 1.0 / self.seen)
        self.drafted += weight * (drafted - self.drafted)
        self.drafted_sq += weight * (drafted * drafted - self.drafted_sq)
        self.extra += weight * (extra - self.extra)
        self.drafted_extra += weight * (drafted * extra - self.drafted_extra)

    def coefficients(self, fixed: float | None = None) -> tuple[float, float]:
        """(fixed seconds per verification, seconds per drafted token), both >= 0. With `fixed`
        given (measured elsewhere), only the part per token is fitted to what is left. Else,
        while the draft lengths seen barely vary, the fixed part cannot be told apart: all per
        token."""
        if fixed is not None:
            per_token = (self.drafted_extra - fixed * self.drafted) / max(self.drafted_sq, 1e-9)
            return fixed, max(per_token, 0.0)
        variance = self.drafted_sq - self.drafted**2
        proportional = (0.0, self.extra / max(self.drafted, 1e-9))
        if variance < MIN_DRAFT_LENGTH_VARIANCE:
            return proportional
        per_token = (self.drafted_extra - self.drafted * self.extra) / variance
        fixed = self.extra - per_token * self.drafted
        return (fixed, per_token) if per_token >= 0.0 and fixed >= 0.0 else proportional


@dataclass
class HopelessProbes:
    """When a source whose drafts cannot pay is tried again: at step `due`, then after a gap
    twice the last. A probe fires once but answers every question asked at its step."""

    due: int
    gap: int = HOPELESS_PROBE_FIRST
    fired: int = -1  # the step of the last probe

    def fires(self, step: int) -> bool:
        """Whether `step` probes (the first asked at or after `due`, or the last probe's)."""
        if step == self.fired:
            return True
        if step < self.due:
            return False
        self.gap = min(2 * self.gap, HOPELESS_PROBE_MAX)
        self.fired, self.due = step, step + self.gap
        return True


class SpeculationCosts:
    """What speculation costs, measured per batch size: a plain decode step's seconds, and per
    draft source (n-gram lookups, a draft model) the seconds a step's drafts add to it
    (`DraftCostFit`: a fixed part per verification, a draft model's taken from the n-gram
    drafts' (`coefficients`), and a part per drafted token: its verification row, and the
    passes that proposed it). A step of a batch of B requests emits B
    tokens, so an accepted token saves 1/B of a plain step of that batch, and a step's `drafted`
    tokens pay when more than `break_even(batch, drafted, source) * drafted` of them are
    accepted; `DraftLength` pauses drafting below it. This separates what the hardware and
    models cost (here) from what the request's text allows (its acceptance)."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}
        self.plain_steps: dict[int, int] = {}  # plain steps measured per batch size
        self.fits: dict[tuple[int, str], DraftCostFit] = {}
        self.steps: dict[int, int] = {}
        self.probes: dict[tuple[int, str], HopelessProbes] = {}  # sources that cannot pay

    def allows_drafts(self, batch_size: int) -> bool:
        """Whether this step may verify speculative drafts: not when it is due to measure the
        plain cost (fewer than PLAIN_WARMUP_STEPS measured at this batch size, or every
        `PLAIN_PROBE_EVERY` steps). Counts the step (`pays` asks about the step last counted)."""
        step = self.steps.get(batch_size, 0)
        self.steps[batch_size] = step + 1
        warm = self.plain_steps.get(batch_size, 0) >= PLAIN_WARMUP_STEPS
        return warm and step % PLAIN_PROBE_EVERY != PLAIN_PROBE_EVERY - 1

    def drafting_requests(self, batch_size: int, source: str) -> int:
        """For how many requests of this step `source` may draft: none where its drafts cannot
        pay (`pays`); one for n-gram drafts while their cost is measured at no batch size
        (`coefficients`): a first step's unpriced drafts for a whole batch verify rows that
        may not pay at any acceptance (on an AVX2 CPU, four requests' three-token drafts cost
        a batch of four about two plain steps), where one request's draft measures the same
        cost per token; else every request. A draft model drafts for every request when
        unpriced too: its passes serve the whole batch at once, so one request's draft would
        measure a pass per token where the batch shares it."""
        if self.coefficients(batch_size, source) is None:  # unpriced: `pays` at any share
            return 1 if source == NGRAM_SOURCE else EVERY_REQUEST
        return EVERY_REQUEST if self.pays(batch_size, source) else 0

    def pays(self, batch_size: int, source: str) -> bool:
        """Whether `source`'s drafts can pay at some acceptance this step: not where a drafted
        token costs a plain step or more however long the draft, except on the probes that
        notice when that changes (`HopelessProbes`, from the step that first found it so)."""
        step = self._last_step(batch_size)
        key = (batch_size, source)
        if self.marginal(batch_size, source) < 1.0:
            self.probes.pop(key, None)
            return True
        probes = self.probes.setdefault(key, HopelessProbes(due=step + HOPELESS_PROBE_FIRST))
        return probes.fires(step)

    def _last_step(self, batch_size: int) -> int:
        """The index of the step `allows_drafts` last counted at this batch size."""
        return max(self.steps.get(batch_size, 1) - 1, 0)

    def _probing(self, batch_size: int, source: str) -> bool:
        """Whether this step is a probe of `source`'s drafts where they cannot pay (`pays`)."""
        probes = self.probes.get((batch_size, source))
        step = self._last_step(batch_size)
        return probes is not None and probes.fired == step

    def worth_verifying(
        self, batch_size: int, proposals: dict[str, Proposal], verifying: bool
    ) -> dict[str, Proposal]:
        """The proposals worth this step's verification: each draft with a `share` whose
        expected accepted tokens save more than its verification rows cost (a row: the n-gram
        drafts' measured cost per token), and those only if together they also pay the
        verification's fixed part, unless the step verifies anyway (`verifying`: another
        draft, such as a grammar's forced tokens, is in it; or a proposal without a share).
        Where that fixed part is large (in a batch, whose rows then take a GEMM), short
        guesses that pay their own rows still lose the step when nothing else is verified.
        Where a source's cost is not yet measured (`drafting_requests`), or its drafts cannot
        pay and this step probes them (`pays`), its drafts are verified, whatever they are
        likely to save, without the other source's, a draft model's first (its passes are
        spent): a
        step whose drafts mix sources measures neither (nor does one that verifies a
        grammar's forced tokens too, after which they are tried again)."""
        sources = {p.source for p in proposals.values()}  # each priced once, not per draft
        unpriced = {source for source in sources if self.coefficients(batch_size, source) is None}
        unpriced |= {source for source in sources if self._probing(batch_size, source)}
        if unpriced:
            chosen = DRAFT_MODEL_SOURCE if DRAFT_MODEL_SOURCE in unpriced else unpriced.pop()
            return {rid: p for rid, p in proposals.items() if p.source == chosen}
        fit = self.coefficients(batch_size, NGRAM_SOURCE)
        if fit is None or batch_size not in self.plain:
            return proposals
        fixed, per_token = fit
        saved = self._saved_per_token(batch_size)
        kept, gain = {}, 0.0
        for rid, proposal in proposals.items():
            if proposal.share is None:
                kept[rid], verifying = proposal, True
            elif proposal.share * saved > per_token:
                kept[rid] = proposal
                gain += (proposal.share * saved - per_token) * len(proposal.tokens)
        if verifying or gain > fixed:
            return kept
        return {}

    def observe(self, batch_size: int, drafted: int, seconds: float, source: str) -> None:
        """A decode step of `batch_size` requests verified `drafted` speculative draft tokens,
        all from `source` (proposing included), and took `seconds`."""
        if drafted == 0:
            measured = self.plain_steps.get(batch_size, 0) + 1
            self.plain_steps[batch_size] = measured
            old = self.plain.get(batch_size)
            if old is not None and measured <= PLAIN_WARMUP_STEPS:
                self.plain[batch_size] = min(old, seconds)
            else:
                self.plain[batch_size] = smooth(old, seconds)
        elif batch_size in self.plain:
            extra = max(0.0, seconds - self.plain[batch_size])
            self.fits.setdefault((batch_size, source), DraftCostFit()).add(drafted, extra)

    def coefficients(self, batch_size: int, source: str) -> tuple[float, float] | None:
        """`source`'s (fixed seconds per verification, seconds per drafted token) at this batch
        size, from the nearest batch size measured until it is (`_nearest_fit`; None while
        none is). A draft model's fixed part is the n-gram drafts' where those are measured: a
        verification costs the same whoever proposed its tokens, and a draft model's lengths
        rarely vary enough to tell its fixed part apart (a pass per token has none of its
        own), where n-gram drafts of 1 to 16 tokens do; else none."""
        ngram = self._nearest_fit(batch_size, NGRAM_SOURCE)
        if source == NGRAM_SOURCE:
            return None if ngram is None else ngram.coefficients()
        fit = self._nearest_fit(batch_size, source)
        if fit is None:
            return None
        return fit.coefficients(ngram.coefficients()[0] if ngram is not None else 0.0)

    def _nearest_fit(self, batch_size: int, source: str) -> DraftCostFit | None:
        """`source`'s cost fit at `batch_size`, else at the nearest batch size measured (the
        smaller of two as near); a draft model's at a larger one only. Its seconds per drafted
        token are its verification rows', which hardly depend on the batch's other rows, and a
        draft model's passes' share, which falls as the batch grows: priced from a larger
        batch, its drafts look no dearer than they are (where even so they cannot pay, they
        cannot), from a smaller one dearer (which would keep them from being measured). One
        measured elsewhere prices drafts at a batch size new to them; unpriced, the first
        drafts there run whatever they cost: on a CPU whose verification rows cost most of a
        plain row's share, a batch of four loses several steps' worth to n-gram drafts, and a
        batch that shrank to two or three as requests finished a second or more to a draft
        model's catch-up on every token since it last drafted."""
        exact = self.fits.get((batch_size, source))
        if exact is not None:
            return exact
        larger_only = source != NGRAM_SOURCE
        sizes = [
            size
            for size, fit_source in self.fits
            if fit_source == source and (size > batch_size or not larger_only)
        ]
        if not sizes:
            return None
        nearest = min(sizes, key=lambda size: (abs(size - batch_size), size))
        return self.fits[(nearest, source)]

    def break_even(self, batch_size: int, drafted: int, source: str) -> float:
        """The acceptance at which a step's `drafted` tokens from `source` pay: the seconds they
        add over the seconds their acceptance would save, a plain step's 1/`batch_size` per
        token (`LOW_ACCEPTANCE` until both are measured)."""
        fit = self.coefficients(batch_size, source)
        if fit is None or drafted <= 0 or batch_size not in self.plain:
            return LOW_ACCEPTANCE
        fixed, per_token = fit
        return (fixed + per_token * drafted) / (drafted * self._saved_per_token(batch_size))

    def break_evens(self, batch_size: int, drafted: int, source: str) -> BreakEvens:
        """The shares at which a step of `batch_size` requests drafting `drafted` tokens from
        `source` pays: for that step, and for the longest drafts (`marginal`); and the seconds
        an accepted token saves in it."""
        saved = self._saved_per_token(batch_size) if batch_size in self.plain else None
        return BreakEvens(
            self.break_even(batch_size, drafted, source), self.marginal(batch_size, source), saved
        )

    def marginal(self, batch_size: int, source: str) -> float:
        """The break-even of an arbitrarily long draft (the fixed part spread to nothing)."""
        fit = self.coefficients(batch_size, source)
        if fit is None or batch_size not in self.plain:
            return LOW_ACCEPTANCE
        return fit[1] / self._saved_per_token(batch_size)

    def _saved_per_token(self, batch_size: int) -> float:
        """Seconds an accepted token saves: the plain step's share of one request."""
        return max(self.plain[batch_size] / batch_size, 1e-9)

    def info(self) -> dict[str, Any]:
        """Per batch size: the plain step, and per draft source the fixed cost of a
        verification, the cost per drafted token, and the break-even of a draft of 1, 4 and 8
        tokens."""
        out: dict[str, Any] = {}
        for size, plain in sorted(self.plain.items()):
            entry: dict[str, Any] = {"plain_step_ms": 1e3 * plain}
            for source in sorted(source for fit_size, source in self.fits if fit_size == size):
                fit = self.coefficients(size, source)
                assert fit is not None  # listed sources have a fit
                fixed, per_token = fit
                costs = {
                    "verify_fixed_ms": 1e3 * fixed,
                    "ms_per_drafted_token": 1e3 * per_token,
                    "break_even_acceptance": {
                        str(d): self.break_even(size, d, source) for d in (1, 4, 8)
                    },
                }
                entry.setdefault("sources", {})[source] = costs
            out[str(size)] = entry
        return out


def smooth(old: float | None, new: float) -> float:
    """`old` moved COST_SMOOTHING of the way to `new` (`new` where there is none yet)."""
    return new if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * new
