"""The speculator the flags choose: n-gram drafts, a draft model's, or both (`NgramBeforeDraft`:
each request's draft from the source likely to gain more on it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.speculation import (
    DRAFT_MODEL_SOURCE,
    NGRAM_SOURCE,
    BreakEvens,
    Proposal,
    SourceFilter,
    Speculator,
    VerifyRows,
)

if TYPE_CHECKING:
    from sglite.runtime.cache.radix_cache import RadixCache
    from sglite.runtime.model.loader import LoadedModel
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.ngram import NgramProposer
    from sglite.runtime.server_args import ServerArgs


class NgramBeforeDraft:
    """Drafts copied from text already seen (n-gram lookups: free) where the request's match
    likely gains as much as the draft model's next draft, else the draft model's (a pass of it
    per token), else the weaker match: a `Speculator` over both, each keeping its own draft
    length and acceptance."""

    def __init__(self, ngram: NgramProposer, model: DraftModelProposer) -> None:
        self.sources: tuple[NgramProposer, DraftModelProposer] = (ngram, model)
        self.last: dict[str, Speculator] = {}  # rid -> the source of its latest draft
        # rid -> its n-gram draft passed over for the draft model's this step
        self.passed: dict[str, list[int]] = {}
        self.proposals = {NGRAM_SOURCE: 0, DRAFT_MODEL_SOURCE: 0}  # drafts proposed, by source

    def speculate(self, reqs: list[Req], allowed: SourceFilter) -> dict[str, Proposal]:
        """Each request's n-gram draft where it likely saves at least as many tokens beyond
        its cost as the draft model's next, or where that cannot pay at all
        (`DraftModelProposer.gain`; a short match in a record being filled is often another
        field's), else the draft model's (one batch of the requests left; while its drafts do
        not pay, only a due probe), else its weaker n-gram draft. A draft model passed over
        for an n-gram draft ages its tally (`DraftModelProposer.passed_over`)."""
        ngram, model = self.sources
        matched = ngram.speculate(reqs, allowed)
        rival = model.gain(len(reqs))
        kept = {rid: p for rid, p in matched.items() if rival <= max(ngram.gain(p), 0.0)}
        if kept:
            model.passed_over()
        drafted = model.speculate([r for r in reqs if r.rid not in kept], allowed)
        self.passed = {rid: matched[rid].tokens for rid in drafted if rid in matched}
        found = {**matched, **drafted}
        for rid, proposal in found.items():
            self.last[rid] = model if rid in drafted else ngram
            self.proposals[proposal.source] += 1
        return found

    def price(self, prices: Callable[[str], BreakEvens]) -> None:
        """Both sources are priced for the step."""
        for source in self.sources:
            source.price(prices)

    def record(self, req: Req, drafted: int, accepted: int, shares: BreakEvens) -> None:
        """Tell the source of the request's latest draft how it fared; where that was the
        draft model's in place of an n-gram draft the target then wrote whole (the tokens kept
        and its own), the n-gram draft length grows as if it had been verified: else a copy
        the draft model takes first keeps its n-gram drafts at their first length, and their
        likely gain below the draft model's ever after (`NgramProposer.shown`)."""
        source = self.last.get(req.rid)
        if source is not None:
            source.record(req, drafted, accepted, shares)
        passed = self.passed.pop(req.rid, None)
        if passed and len(passed) <= accepted + 1:
            ngram, _ = self.sources
            written = req.output_ids[len(req.output_ids) - accepted - 1 :]
            if written[: len(passed)] == passed:
                ngram.shown(req, len(passed))

    def read_prompt(self, req: Req) -> None:
        """Both sources read the prompt."""
        for source in self.sources:
            source.read_prompt(req)

    def forget(self, live: set[str]) -> None:
        """Both sources forget the requests not in `live`."""
        for source in self.sources:
            source.forget(live)
        self.last = {rid: s for rid, s in self.last.items() if rid in live}
        self.passed = {rid: t for rid, t in self.passed.items() if rid in live}

    def flush(self) -> None:
        """Both sources drop what they cache across requests."""
        for source in self.sources:
            source.flush()

    def take_prompt_seconds(self) -> float:
        """Both sources' prompt seconds."""
        return sum(source.take_prompt_seconds() for source in self.sources)

    def check_invariants(self) -> None:
        """Both sources' own checks."""
        for source in self.sources:
            source.check_invariants()

    def info(self) -> dict[str, Any]:
        """Both sources' settings (the algorithm is the draft model's) and the drafts each
        proposed."""
        ngram, model = self.sources
        return {
            **ngram.info(),
            **model.info(),
            "speculative_draft_ngram": True,
            "speculative_proposals": dict(self.proposals),
        }


def build_speculator(
    args: ServerArgs,
    target: LoadedModel,
    context_len: int,
    capacity: int,
    cache: RadixCache | None,
) -> Speculator | None:
    """The speculator `args` ask for (None when speculation is off). A draft model is loaded
    here, its KV pool sized to `capacity` tokens like the target's; n-gram drafts also read the
    target's radix `cache` (None when it is disabled); with a draft model they come first
    (`NgramBeforeDraft`) unless `speculative_draft_ngram` is off. Drafts of both are sized for
    the target's verification rows (`VerifyRows`, from its kernels)."""
    from sglite.runtime.model.weight_policy import verification_row_group
    from sglite.runtime.scheduler.ngram import NgramProposer

    rows = VerifyRows(verification_row_group(target.model))
    ngram = NgramProposer(
        context_len,
        args.speculative_num_draft_tokens,
        args.speculative_ngram_min_match_window_size,
        args.speculative_ngram_max_match_window_size,
        cache,
        rows,
    )
    if args.speculative_algorithm == "ngram":
        return ngram
    if args.speculative_algorithm == "draft":
        from sglite.runtime.scheduler.draft_model import DraftModelProposer

        model = DraftModelProposer.load(args, target, context_len, capacity, rows)
        return NgramBeforeDraft(ngram, model) if args.speculative_draft_ngram else model
    return None
