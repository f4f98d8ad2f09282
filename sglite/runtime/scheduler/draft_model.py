"""Draft-model speculation: a smaller model with the target's tokenizer proposes the draft.

`--speculative-algorithm draft --speculative-draft-model-path P` loads P as a second model in
the scheduler process. Per running request it keeps the draft model's K/V of the request's
tokens (`DraftSequence`) in its own `KVPool`, under its own `RadixCache`, so a prompt prefix
the draft model has seen before costs it nothing (`draft_model_kv.DraftKV` owns them and runs
the passes; this module decides when and how far to draft). Each decode step the draft model
catches up on the tokens the target emitted since (usually one), then proposes its greedy
continuation token by token, one pass per token for all the step's requests it drafts for; the
target verifies the drafts in its next forward (`drafts.DraftVerifier`).
After a rejection the draft sequence is cut back to the tokens the target kept: its K/V follows
the target's accepted tokens, never the rejected ones.

A draft grows token by token while it is likely to be accepted whole: the draft model's own
probability of each token it chose, scaled by how well such probabilities have predicted the
target's agreement so far (`ConfidenceCalibration`) and multiplied along the draft, must stay
above the share of accepted tokens at which a draft token pays (the break-even the scheduler
measures), priced by the pass (`DraftPassCost`: its seconds split among the drafts it grows).
A draft pass costs a fair share of a target step on a CPU (the 0.5B drafting for the 1.5B:
~0.3-0.4), so a pass whose tokens would likely be rejected is not run, nor one that would
grow a lone draft in a batch whose plain step's share of one request is below its cost.

The draft is the draft model's greedy choice, a point distribution, so the verifier's rule (keep
a draft token while the target's own sample equals it) is speculative sampling's accept rule
for that draft: outputs follow token-by-token decoding of the target exactly, greedy or sampled
(see drafts.py), whatever the draft model. A draft model only changes the speed.

Self-speculation: the draft may be the target's own file, with `--speculative-draft-num-layers
N` (its first N layers, then its final norm and output projection: an early exit) and/or
`--speculative-draft-model-quantization` (a cheaper weight format).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglite.runtime.scheduler.draft_model_kv import DraftKV
from sglite.runtime.scheduler.draft_model_state import (
    ConfidenceCalibration,
    DraftPassCost,
    DraftSequence,
    GrowingDraft,
)
from sglite.runtime.scheduler.draft_tally import KindAcceptance
from sglite.runtime.scheduler.draft_vocabulary import DraftVocabulary
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.speculation import (
    DRAFT_MODEL_SOURCE,
    LOW_ACCEPTANCE,
    UNGROUPED_ROWS,
    BreakEvens,
    DraftLength,
    Proposal,
    SourceFilter,
    VerifyRows,
    draft_room,
    proposals_from,
)

if TYPE_CHECKING:
    from sglite.runtime.model.loader import LoadedModel
    from sglite.runtime.server_args import ServerArgs


# A probe (a draft while the draft model does not pay: `KindAcceptance.admit`) waits for a
# request the draft model holds all but at most this many tokens of, such as one starting to
# decode (its prompt read as the target prefilled it): a probe of a request it fell behind on
# would first pass over every token emitted since, a cost no acceptance repays.
PROBE_MAX_BEHIND = 4
# While the draft model does not pay, one prompt in this many is read as the target prefills
# it (the rest when a draft needs them): a prompt's pass costs the draft model a prefill, which
# drafts that are not taken never repay (at batch 4 on the Qwen pair, a tenth of the
# throughput), and the prompts read keep requests that a probe can try cheaply.
PROMPT_READ_EVERY_UNPAID = 8


class DraftModelProposer:
    """Drafts from a second, smaller model (a `speculation.Speculator`)."""

    def __init__(
        self,
        draft: LoadedModel,
        context_len: int,
        num_draft_tokens: int,
        capacity: int,
        vocab: DraftVocabulary | None = None,
        rows: VerifyRows = UNGROUPED_ROWS,
    ) -> None:
        self.kv = DraftKV(draft, context_len, capacity, vocab)
        self.model_path = draft.model_path
        self.quantization = draft.quantization
        self.context_len = context_len
        self.num_draft_tokens = num_draft_tokens
        self.rows = rows  # how drafts are sized for the target's verification
        self.sequences: dict[str, DraftSequence] = {}
        self.steps = 0  # calls to propose_many (a probe gap counts them)
        self.prompt_seconds = 0.0  # catch-up passes over prompt tokens, until taken
        # Its recent drafts over all requests (a new request would otherwise spend its first
        # drafts relearning what the last one saw): while they do not cover their cost, it
        # drafts only as a probe; a pass skipped is a catch-up deferred, which a later pass
        # does for several tokens at nearly one token's cost.
        self.acceptance = KindAcceptance()
        self.needed = LOW_ACCEPTANCE  # a long draft's break-even in this step (`price`)
        self.saved_seconds: float | None = None  # what an accepted token saves (`price`)
        self.pass_cost = DraftPassCost()
        self.calibration = ConfidenceCalibration()
        self.prompts_unread = 0  # prompts left unread since the last one read while not paying
        # the request whose prompt was read for the probe now due (one will do), while it runs
        self.probe_prompt_for: str | None = None

    @classmethod
    def load(
        cls,
        args: ServerArgs,
        target: LoadedModel,
        context_len: int,
        capacity: int,
        rows: VerifyRows = UNGROUPED_ROWS,
    ) -> DraftModelProposer:
        """The proposer of `args.speculative_draft_model_path` (`draft_model_loading`), its
        drafts sized by `rows` (the target's)."""
        from sglite.runtime.scheduler.draft_model_loading import load_draft_model

        draft, vocab = load_draft_model(args, target)
        num_draft_tokens = args.speculative_num_draft_tokens
        return cls(draft, context_len, num_draft_tokens, capacity, vocab, rows)

    # ------------------------------------------------------------------ Speculator
    def propose(self, req: Req) -> list[int]:
        """The draft model's greedy continuation of `req` (`propose_many` of one request)."""
        return self.propose_many([req]).get(req.rid, [])

    def propose_many(self, reqs: list[Req]) -> dict[str, list[int]]:
        """The draft model's greedy continuation of each request that drafts now, up to its
        draft length (the `DraftProposer` bound holds; shorter when the draft pool is full),
        token by token for all of them at once: one pass of the draft model per token,
        whatever the number of requests."""
        self.steps += 1
        drafting = [d for d in (self._begin(req, len(reqs)) for req in reqs) if d is not None]
        paid = [d for d in drafting if not d.probe]
        if paid and not self._first_pass_pays(paid, len(drafting), len(reqs)):
            drafting = [d for d in drafting if d.probe]  # the others' catch-up deferred
        drafts = {d.rid: d.tokens for d in drafting}
        passes, first = 0, True
        while drafting:
            start = time.perf_counter()
            choices = self.kv.extend_many([(d.seq, d.feed) for d in drafting])
            seconds = time.perf_counter() - start
            passes += 1
            if first:
                self.pass_cost.add_catch_up(seconds, sum(len(d.feed) for d in drafting))
            if any(d.reads_prompt for d in drafting):  # a first pass over a prompt
                self.prompt_seconds += seconds
                for d in drafting:
                    if d.reads_prompt:
                        self.kv.share(d.seq)
            elif not first:  # a first pass also catches up on the target's new tokens
                self.pass_cost.add_pass(seconds)
            first = False
            growing = []
            for d, choice in zip(drafting, choices, strict=True):
                if choice is None or choice[0] >= self.kv.vocab_size:
                    continue
                d.tokens.append(choice[0])
                d.seq.probabilities.append(choice[1])
                d.whole *= self.calibration.agreement(choice[1])
                if len(d.tokens) < d.length:
                    d.feed, d.reads_prompt = [choice[0]], False
                    growing.append(d)
            drafting = self.pass_cost.worth_a_pass(
                growing, self.needed, self.saved_seconds, len(reqs)
            )
        made = {rid: tokens for rid, tokens in drafts.items() if tokens}
        drafted = sum(len(tokens) for tokens in made.values())
        self.pass_cost.add_draft(len(reqs), passes, drafted, len(made))
        return made

    def _first_pass_pays(self, paid: list[GrowingDraft], count: int, offered: int) -> bool:
        """Whether a first pass drafting for `count` of the `offered` requests pays for the
        `paid` ones among them, whose drafts pay (a probe runs regardless): their first tokens
        as likely kept as their recent drafts' tokens (`KindAcceptance.expected_share_for`),
        against their share of the pass (a pass for fewer requests than usual costs each of
        them more)."""
        needed = self.pass_cost.needed(self.needed, self.saved_seconds, count, offered)
        shares = [self._likely_kept(d.seq) for d in paid]
        return sum(shares) / len(shares) >= needed

    def _likely_kept(self, seq: DraftSequence) -> float:
        """The share of the next draft for the request of `seq` likely kept: its own recent
        drafts' with the workload's as prior (`KindAcceptance.expected_share_for`), or 1 while
        both are too few to tell (`KindAcceptance.unknown_for`: drafting is how they learn)."""
        if self.acceptance.unknown_for(seq.drafts):
            return 1.0
        return self.acceptance.expected_share_for(seq.drafts)

    def gain(self, batch_size: int) -> float:
        """The tokens its next draft for one request of a step of `batch_size` likely saves
        beyond what it costs: its drafts' mean length times how far their likely kept share
        is above what a lone draft's tokens need to pay for their verification and its passes
        (`DraftPassCost.needed`). That share is its drafts' recent one
        (`KindAcceptance.expected_share`) while they pay, else 1: the most a probe can find."""
        needed = self.pass_cost.needed(self.needed, self.saved_seconds, 1, batch_size)
        share = self.acceptance.expected_share if self._pays() else 1.0
        return (share - needed) * self.pass_cost.tokens_per_draft

    def _catch_up_pays(self, req: Req, behind: int, offered: int) -> bool:
        """Whether catching up on the `behind` tokens of `req` it does not hold (a prompt it
        did not read, the tokens emitted while its drafts paused) likely pays: their pass, at
        the measured seconds per token, against what its drafts over the request's remaining
        tokens likely save (`gain` per draft, a draft and the model's own token per step).
        Until both are measured, it does (measuring them)."""
        per_token, saved = self.pass_cost.catch_up_seconds, self.saved_seconds
        if per_token is None or saved is None:
            return True
        drafts = req.remaining_new_tokens / (self.pass_cost.tokens_per_draft + 1.0)
        return max(self.gain(offered), 0.0) * saved * drafts > per_token * behind

    def passed_over(self) -> None:
        """An n-gram draft was preferred to its own: its tally ages (`KindAcceptance.age`), so
        that a share learned on earlier text is tried again on this one."""
        self.acceptance.age()

    def _pays(self) -> bool:
        """Whether drafts pay now: the recent drafts' accepted tokens against their cost."""
        return self.acceptance.covers_cost()

    def _pays_for(self, seq: DraftSequence) -> bool:
        """Whether drafts for the request of `seq` pay now: its own recent drafts with the
        recent ones of all requests as their prior (`KindAcceptance.covers_cost_for`); so
        they do while both are too few to tell (`KindAcceptance.unknown_for`)."""
        tally = self.acceptance
        return tally.unknown_for(seq.drafts) or tally.covers_cost_for(seq.drafts)

    def _begin(self, req: Req, offered: int) -> GrowingDraft | None:
        """The request's draft about to grow (its sequence brought to the request's tokens),
        or None when it drafts nothing now (in a proposal for `offered` requests)."""
        seq = self.sequences.get(req.rid)
        if seq is None:
            seq = self.sequences[req.rid] = self._start(req)
        length = seq.length.next(draft_room(req, self.context_len))
        if length <= 0:
            return None
        target = seq.history.sync(req)
        held = seq.held(target)
        behind = len(target) - held
        paying = self._pays_for(seq)
        # in step, or its remaining tokens would repay the catch-up should drafts pay (for a
        # probe: a long request whose prompt went unread while they did not, else no probe
        # comes while it runs)
        in_step = behind <= PROBE_MAX_BEHIND or self._catch_up_pays(req, behind, offered)
        if paying and not in_step:
            return None
        # a probe is worth its pass there, where a draft kept whole pays
        cheap = in_step and (paying or self.gain(offered) > 0)
        if not self.acceptance.admit(paying, self.steps, cheap=cheap):
            return None
        self.probe_prompt_for = None
        vocab = self.kv.vocab
        if vocab is not None and seq.extra is not None:  # what it wrote, a candidate
            seq.extra = vocab.with_written(seq.extra, target)
        self.kv.rewind(seq, target, held)
        seq.probabilities = []
        reads_prompt = len(seq.tokens) < len(req.prompt_ids)
        feed = target[len(seq.tokens) :]
        return GrowingDraft(req.rid, seq, length, feed, reads_prompt, probe=not paying)

    def read_prompt(self, req: Req) -> None:
        """The draft model's pass over the prompt (past what its cache holds), run as the target
        prefills it, so the first draft costs one token's pass: while drafts pay, and while they
        do not for one prompt in PROMPT_READ_EVERY_UNPAID and for one prompt when a probe is due
        where a lone draft could pay (as its latest verification priced it: at batch 1, not at
        batch 4 on the Qwen pair on a CPU); a prompt left unread is read by the request's first
        draft, if one comes. A request it already follows (re-prefilled after a retraction) is
        left as it is."""
        if req.rid in self.sequences:
            return
        if not self._pays():
            self.prompts_unread += 1
            # a due probe waits for a request in step, where a lone draft can pay at all; one
            # prompt read for it will do (the batch's other prompts are left unread)
            due = self.acceptance.probe_due and self.probe_prompt_for is None and self.gain(1) > 0
            if self.prompts_unread < PROMPT_READ_EVERY_UNPAID and not due:
                return
            if self.acceptance.probe_due:
                self.probe_prompt_for = req.rid
        self.prompts_unread = 0
        seq = self.sequences[req.rid] = self._start(req)
        feed = req.prompt_ids[len(seq.tokens) :]
        start = time.perf_counter()
        if feed and self.kv.extend(seq, feed) is not None:
            seq.verified = len(seq.tokens)
            self.pass_cost.add_catch_up(time.perf_counter() - start, len(feed))
            self.kv.share(seq)

    def speculate(self, reqs: list[Req], allowed: SourceFilter) -> dict[str, Proposal]:
        """`propose_many`'s drafts as the DRAFT_MODEL_SOURCE's."""
        return proposals_from(DRAFT_MODEL_SOURCE, self.propose_many, reqs, allowed)

    def price(self, prices: Callable[[str], BreakEvens]) -> None:
        """Judge this step's drafts and passes by its batch size's costs."""
        shares = prices(DRAFT_MODEL_SOURCE)
        self.needed = max(shares.least, LOW_ACCEPTANCE)
        if shares.saved_seconds is not None:
            self.saved_seconds = shares.saved_seconds

    def record(self, req: Req, drafted: int, accepted: int, shares: BreakEvens) -> None:
        """Adapt the request's draft length, the confidence calibration and the recent value of
        drafts to a verification's result (`shares.needed`: the break-even of the step's
        drafts; `shares.least`, that of the longest drafts, bounds how long a draft grows)."""
        seq = self.sequences.get(req.rid)
        if seq is not None:
            seq.length.record(drafted, accepted, shares)
            seq.drafts.record(drafted, accepted, shares.needed)
            self.calibration.record(seq.probabilities[:drafted], accepted)
        self.acceptance.record(drafted, accepted, shares.needed)
        self.needed = max(shares.least, LOW_ACCEPTANCE)
        self.saved_seconds = shares.saved_seconds

    def take_prompt_seconds(self) -> float:
        """The seconds of catch-up passes that read prompt tokens since the last call."""
        seconds, self.prompt_seconds = self.prompt_seconds, 0.0
        return seconds

    def forget(self, live: set[str]) -> None:
        """Cache the verified tokens of requests not in `live` (so a later request with the
        same prefix reuses them) and release the rest of their slots."""
        for rid in [rid for rid in self.sequences if rid not in live]:
            self.kv.release(self.sequences.pop(rid))
        if self.probe_prompt_for not in live:  # it ended before the probe came
            self.probe_prompt_for = None

    def flush(self) -> None:
        """Empty the draft cache; called with no request in flight, so every sequence (an
        aborted request's may linger until the next decode step) is released first."""
        self.forget(set())
        self.kv.flush()

    def info(self) -> dict[str, Any]:
        """The draft model, its pool and cache, for get_server_info."""
        cost, kv = self.pass_cost, self.kv
        return {
            "speculative_algorithm": "draft",
            "speculative_verify_row_group": self.rows.group,
            "speculative_draft": {
                "model_path": self.model_path,
                "num_layers": kv.model.config.num_layers,
                "quantization": self.quantization,
                "pool_tokens": kv.pool.capacity,
                "cached_tokens": kv.cache.total_size(),
                "forward_passes": kv.forward_passes,
                "vocab_size": kv.vocab_size if kv.vocab is None else kv.vocab.size,
                "drafts": self.acceptance.info(),
                "agreement_per_probability": self.calibration.factor,
                "pass_ms": None if cost.pass_seconds is None else 1e3 * cost.pass_seconds,
                "passes_per_drafted_token": {
                    str(offered): share for offered, share in sorted(cost.passes_per_token.items())
                },
            },
        }

    # ------------------------------------------------------------------ bookkeeping
    def check_invariants(self) -> None:
        """The draft pool's slots are each free, cached or held by one sequence
        (`DraftKV.check_invariants`); raises otherwise."""
        self.kv.check_invariants(self.sequences.values())

    def _start(self, req: Req) -> DraftSequence:
        """A new sequence for `req` (`DraftKV.start`): its requests drafted by their tallies
        (`_pays_for`, probes), not DraftLength's windows."""
        sizes = DraftLength(self.num_draft_tokens, self.rows, pauses=False)
        return self.kv.start(req, sizes)
