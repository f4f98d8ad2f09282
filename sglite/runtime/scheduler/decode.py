"""The decode step: one token, plus any accepted draft tokens, for every running request.

`DecodeManager.run` is the scheduler's decode step: plan each running request's draft (the
tokens its grammar forces, else a speculative one), make room in the pool (dropping drafts,
then retracting the least advanced requests), run one forward (a plain DECODE, or one row per
token when drafts ride along: `drafts.VerifyBatch`), then sample and verify. With
`--speculative-adaptive` the step is timed for `SpeculationCosts`, which decides whether drafts
pay.

Invariants: after `run`, every request left `RUNNING` in the request table is unfinished and
owns one KV slot per token of its sequence that has K/V; draft slots not kept are freed; the
speculator keeps state only for running requests.
"""

from __future__ import annotations

import time

import torch

from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode, build_decode_rows
from sglite.runtime.scheduler.budget import KVBudget
from sglite.runtime.scheduler.drafts import (
    SPECULATION,
    DraftProposer,
    DraftVerifier,
    ForcedTokenProposer,
    VerifyBatch,
)
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.model_runner import ModelRunner
from sglite.runtime.scheduler.output import OutputProcessor
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable
from sglite.runtime.scheduler.speculation import EVERY_REQUEST, BreakEvens, Speculator
from sglite.runtime.scheduler.speculation_costs import SpeculationCosts
from sglite.runtime.scheduler.stats import SchedulerStats
from sglite.runtime.scheduler.token_sampler import TokenSampler
from sglite.runtime.server_args import ServerArgs

# Running requests up to which speculative drafts are verified: past a few rows a decode step
# stops being bound by reading the weights, and verification rows then cost every request.
SPEC_MAX_BATCH = 4


class DecodeManager:
    """Runs the scheduler's decode steps and owns their drafts: the jump-forward proposer, the
    speculator (None when speculation is off) and its measured costs."""

    def __init__(
        self,
        args: ServerArgs,
        table: RequestTable,
        runner: ModelRunner,
        sampler: TokenSampler,
        output: OutputProcessor,
        kv: RequestKVManager,
        budget: KVBudget,
        stats: SchedulerStats,
        speculator: Speculator | None,
        jump_forward_context_len: int | None,
    ) -> None:
        """`jump_forward_context_len`: exact jump-forward drafts up to this context length
        (None: no jump-forward drafts)."""
        self.table = table
        self.runner = runner
        self.sampler = sampler
        self.output = output
        self.kv = kv
        self.budget = budget
        self.stats = stats
        self.proposer: DraftProposer | None = None
        if jump_forward_context_len is not None:
            self.proposer = ForcedTokenProposer(jump_forward_context_len)
        self.verifier = DraftVerifier(runner.pool, stats)
        self.speculator = speculator
        self.speculated: dict[str, str] = {}  # rid -> the source of its speculative draft
        self.spec_costs: SpeculationCosts | None = None
        if self.speculator is not None and args.speculative_adaptive:
            self.spec_costs = SpeculationCosts()

    def running(self) -> list[Req]:
        return self.table.with_status(ReqStatus.RUNNING)

    def read_prompts(self, prefilled: list[Req]) -> None:
        """The speculator reads the prompts of the requests just prefilled that now decode (a
        draft model's pass over each, in the prefill step rather than the first decode step's);
        a request whose speculator fails ends here, as in `_plan_drafts`."""
        if self.speculator is None:
            return
        for req in prefilled:
            if self.table.status(req) is not ReqStatus.RUNNING:
                continue
            try:
                self.speculator.read_prompt(req)
            except Exception as exc:
                self.output.fail(req, exc)

    def run(self) -> None:
        """One token (plus any accepted draft tokens) for every running request; with
        `speculative_adaptive`, the step is timed for `SpeculationCosts`."""
        if self.spec_costs is None or self.table.count(ReqStatus.RUNNING) > SPEC_MAX_BATCH:
            self._step()
            return
        start = time.perf_counter()
        measured = self._step()
        # A draft model's first pass over a request's prompt is that request's one-time cost,
        # not its drafts': counted, it would price the draft model out for a thousand steps.
        prompt_seconds = self.speculator.take_prompt_seconds()  # type: ignore[union-attr]
        if measured is not None:
            size, drafted, source = measured
            seconds = time.perf_counter() - start - prompt_seconds
            self.spec_costs.observe(size, drafted, seconds, source)

    def _step(self) -> tuple[int, int, str] | None:
        """The decode step; returns (its batch size, its speculative draft tokens, their
        source) when its cost says what one source's speculation costs: None when it also
        verified jump-forward drafts or drafts of two sources, or lost requests to retraction."""
        drafts = self._plan_drafts()
        planned = self.table.count(ReqStatus.RUNNING)
        self._make_room(drafts)
        reqs = self.running()
        if not reqs:
            return None
        speculative = sum(len(d) for rid, d in drafts.items() if rid in self.speculated)
        sources = set(self.speculated.values())
        comparable = (
            len(reqs) == planned
            and all(rid in self.speculated for rid in drafts)
            and len(sources) <= 1
        )
        if drafts or any(r.num_fill - len(r.kv_slots) > 1 for r in reqs):
            self._run_verify(reqs, drafts, speculative)
        else:
            self._run_plain(reqs)
        self.stats.decode_passes += 1
        if self.speculator is not None:  # finished, retracted or aborted requests' state goes
            self.speculator.forget({req.rid for req in self.running()})
        self.budget.decode_step_done()
        return (planned, speculative, min(sources, default="")) if comparable else None

    def _run_plain(self, reqs: list[Req]) -> None:
        """A DECODE of one token per request."""
        for req in reqs:
            req.kv_slots.extend(self.kv.alloc(1))
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            [[req.output_ids[-1]] for req in reqs],
            [len(req.kv_slots) - 1 for req in reqs],
            [req.kv_slots for req in reqs],
            list(range(len(reqs))),
            self.runner.device,
            slot_tensors=[req.slot_mirror.view(req.kv_slots) for req in reqs],
        )
        self.sampler.sample_and_append(reqs, self.runner.forward(fb))

    def _plan_drafts(self) -> dict[str, list[int]]:
        """Each running request's draft to verify this step: the tokens its grammar forces
        (jump-forward), else a speculative one (small batches only: a large batch is compute
        bound, and verification rows would slow every request in it). A request whose
        jump-forward proposer fails ends here, and the requests a failed speculator proposed
        for (it proposes for all of them at once)."""
        drafts: dict[str, list[int]] = {}
        self.speculated = {}
        running = self.running()
        size, costs = len(running), self.spec_costs
        speculate = self.speculator is not None and size <= SPEC_MAX_BATCH
        if speculate and costs is not None:
            speculate = costs.allows_drafts(size)

        def allowed(source: str) -> int:
            return EVERY_REQUEST if costs is None else costs.drafting_requests(size, source)

        if speculate and costs is not None:
            self.speculator.price(  # type: ignore[union-attr]
                lambda source: costs.break_evens(size, 1, source)
            )
        undrafted = []
        for req in running:
            try:
                draft = self.proposer.propose(req) if self.proposer is not None else []
            except Exception as exc:
                self.output.fail(req, exc)
                continue
            if draft:
                drafts[req.rid] = draft
            else:
                undrafted.append(req)
        if speculate and undrafted:
            try:  # the speculator proposes for all of them at once (a draft model's batch)
                proposals = self.speculator.speculate(undrafted, allowed)  # type: ignore[union-attr]
            except Exception as exc:
                for req in undrafted:
                    self.output.fail(req, exc)
                return drafts
            if costs is not None:
                proposals = costs.worth_verifying(size, proposals, verifying=bool(drafts))
            for rid, proposal in proposals.items():
                drafts[rid] = proposal.tokens
                self.speculated[rid] = proposal.source
        return drafts

    def _run_verify(self, reqs: list[Req], drafts: dict[str, list[int]], speculative: int) -> None:
        """A decode step that also verifies the drafts (`speculative` of their tokens are
        speculative), as one row per token (see `VerifyBatch`)."""
        sample = self.sampler.sample_and_append
        batch = VerifyBatch.plan(reqs, drafts, self.kv.alloc)
        logits = self.runner.forward(self._verify_forward_batch(reqs, batch))
        plain = batch.plain()
        if plain:
            rows = torch.tensor([item.first_row for item in plain], device=logits.device)
            sample([item.req for item in plain], logits.index_select(0, rows))
        shares: dict[str, BreakEvens] = {}  # by draft source
        for item in batch.drafted():
            rows = logits[item.first_row : item.first_row + len(item.draft) + 1]
            source = self.speculated.get(item.req.rid)
            if source is None:
                self.verifier.verify(item.req, item.draft, item.kept, rows, sample)
                continue
            # the step's speculative drafts pay or not together
            if source not in shares:
                shares[source] = (
                    self.spec_costs.break_evens(len(reqs), speculative, source)
                    if self.spec_costs is not None
                    else BreakEvens.uniform()
                )
            verdict = self.verifier.verify(
                item.req, item.draft, item.kept, rows, sample, SPECULATION
            )
            item.req.spec_verify_ct += 1
            self.stats.spec_verify_passes += 1
            assert self.speculator is not None
            self.speculator.record(item.req, len(item.draft), verdict.accepted, shares[source])

    def _verify_forward_batch(self, reqs: list[Req], batch: VerifyBatch) -> ForwardBatch:
        """The verification pass: each request's tokens without K/V and its draft as DECODE
        rows, one per token (`build_decode_rows`)."""
        feeds = [
            (ids, start, req.kv_slots, req.slot_mirror.view(req.kv_slots))
            for req, ids, start in zip(reqs, batch.token_ids, batch.prefix_lens, strict=True)
        ]
        return build_decode_rows(feeds, batch.logit_rows, self.runner.device)

    def _make_room(self, drafts: dict[str, list[int]]) -> None:
        """Drop drafts, then retract the partly prefilled request and the least advanced
        running ones, until every running request has slots for its tokens without K/V."""

        def need() -> int:
            running = self.running()
            own = sum(r.num_fill - len(r.kv_slots) for r in running)
            return own + sum(len(drafts.get(r.rid, ())) for r in running)

        def room() -> int:
            return self.runner.pool.num_free + self.kv.cache.evictable_size()

        if drafts and room() < need():
            drafts.clear()
        while room() < need():
            running = self.running()
            if self.table.chunked is not None:
                req = self.table.chunked
            elif len(running) > 1:
                req = min(running, key=lambda r: (len(r.output_ids), -r.arrival_time))
            else:
                raise RuntimeError("KV pool exhausted by a single request (capacity check failed)")
            self.budget.retract(req)
            self.budget.estimate_was_low()
