"""The prefill step: which requests are admitted and how many tokens each, then the pass.

`schedule` picks the batch: the partly prefilled request's next chunk first, then `WAITING`
requests in policy order (`policy.py`), each taking its longest cached prefix and slots for
the rest, while the step's token budget (`--chunked-prefill-size`, `--max-prefill-tokens`),
`--max-running-requests` and the KV budget (`budget.py`) allow. `run` computes the batch in
one EXTEND pass and samples the first token of every request whose prompt is complete.

Invariants: one request at a time is partly prefilled (`CHUNKED`); a request admitted to the
batch is `PREFILLING` until the pass ends, then `RUNNING`, `CHUNKED` or finished.
"""

from __future__ import annotations

import time

import torch

from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.multimodal.vision_encoder import VisionEncoder
from sglite.runtime.scheduler.budget import KVBudget
from sglite.runtime.scheduler.disaggregation import Disaggregation
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.model_runner import ModelRunner
from sglite.runtime.scheduler.output import OutputProcessor
from sglite.runtime.scheduler.policy import order_waiting, shares_with_batch
from sglite.runtime.scheduler.prefill import PrefillBatch, collect_input_logprobs
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable
from sglite.runtime.scheduler.stats import SchedulerStats
from sglite.runtime.scheduler.token_sampler import TokenSampler
from sglite.runtime.server_args import ServerArgs

# (request, tokens it computes in this pass)
PrefillPlan = list[tuple[Req, int]]


class PrefillManager:
    """Admits requests into prefill passes and runs them (module docstring)."""

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
        vision: VisionEncoder | None,
        disagg: Disaggregation | None,
    ) -> None:
        self.args = args
        self.table = table
        self.runner = runner
        self.sampler = sampler
        self.output = output
        self.kv = kv
        self.budget = budget
        self.stats = stats
        self.vision = vision
        self.disagg = disagg

    @property
    def cache(self) -> RadixCache | None:
        """The radix cache the waiting order looks at (None with --disable-radix-cache)."""
        return self.kv.cache if self.kv.cache_enabled else None

    def schedule(self) -> PrefillPlan:
        """The next prefill batch, its requests moved to `PREFILLING` (empty: nothing fits)."""
        tokens = min(self.args.chunked_prefill_size, self.args.max_prefill_tokens)
        batch: PrefillPlan = []
        chunking = self._continue_chunked(batch, tokens)
        tokens -= sum(n for _, n in batch)
        waiting = self.table.with_status(ReqStatus.WAITING)
        if not waiting:
            return batch
        args, now = self.args, time.monotonic()
        policy, starvation = args.schedule_policy, args.starvation_timeout
        ordered = order_waiting(waiting, policy, self.cache, now, starvation)
        reserved = self.budget.reserved_tokens()
        room_for = args.max_running_requests - self.table.count(ReqStatus.RUNNING)
        for req in ordered:
            if tokens <= 0 or len(batch) >= room_for:
                break
            matched = self.kv.match_and_lock(req)
            if shares_with_batch(req, matched, batch):
                self.kv.unlock(req)
                continue
            extend = req.num_fill - matched
            n = min(extend, tokens)
            own_reserve = self.budget.own_reserve(req)
            if (n < extend and chunking) or not self.kv.can_fit(n, reserved + own_reserve):
                self.kv.unlock(req)
                break
            reserved += own_reserve
            self._admit(req, matched, n)
            chunking = n < extend
            batch.append((req, n))
            tokens -= n
        return batch

    def _continue_chunked(self, batch: PrefillPlan, tokens: int) -> bool:
        """Put the partly prefilled request's next chunk in `batch`, or retract it when the
        pool has no room; True when it continues (no other request may then be cut)."""
        chunked = self.table.chunked
        if chunked is None:
            return False
        n = min(tokens, chunked.num_fill - len(chunked.kv_slots))
        if not self.kv.can_fit(n, self.budget.reserved_tokens()):
            self.budget.retract(chunked)
            return False
        chunked.kv_slots.extend(self.kv.alloc(n))
        self.table.move(chunked, ReqStatus.PREFILLING)
        batch.append((chunked, n))
        return True

    def _admit(self, req: Req, matched: int, n: int) -> None:
        """Give `req` slots for `n` tokens after its `matched` cached ones; the first admission
        records what the cache served."""
        req.kv_slots.extend(self.kv.alloc(n))
        self.table.move(req, ReqStatus.PREFILLING)
        if not req.admitted_once:
            req.cached_tokens = matched
            req.admitted_once = True
            self.kv.cache.record_query(len(req.prompt_ids), matched)
            self.kv.record_admission(req)

    def run(self, batch: PrefillPlan) -> None:
        """Compute the admitted chunks; requests whose prompt is now complete start running,
        a request with more to prefill becomes the partly prefilled one."""
        plan = PrefillBatch.plan(batch)
        fb = self._forward_batch(plan, batch)
        start_time = time.perf_counter()
        logits = self.runner.forward(fb)
        for item in plan.items:
            if item.req.pooling is not None and fb.hidden is not None:
                item.req.pooling.add(fb.hidden[item.hidden[0] : item.hidden[1]])
        self.kv.observe_prefill(plan.num_tokens, time.perf_counter() - start_time)
        self.stats.prefill_passes += 1
        self.stats.prefill_tokens_computed += plan.num_tokens
        to_sample: list[tuple[Req, int]] = []
        for item in plan.items:
            req = item.req
            if req.wants_input_logprobs:
                collect_input_logprobs(item, logits, self.sampler.sampler)
            if len(req.kv_slots) < req.num_fill:
                self.kv.cache_unfinished(req)
                self.table.move(req, ReqStatus.CHUNKED)
                if self.disagg is not None:
                    self.disagg.prefilled_chunk(req)
                continue
            req.input_logprobs_done = True
            if req.params.max_new_tokens == 0:
                self.output.finish(req, {"type": "length", "length": 0})
                continue
            self.kv.cache_unfinished(req)
            to_sample.append((req, item.last_row))
        if to_sample:
            self._sample_first_tokens(to_sample, logits)

    def _forward_batch(self, plan: PrefillBatch, batch: PrefillPlan) -> ForwardBatch:
        fb = ForwardBatch.build(
            ForwardMode.EXTEND,
            plan.token_ids,
            plan.prefix_lens,
            [req.kv_slots for req, _ in batch],
            plan.logit_rows,
            self.runner.device,
        )
        if self.vision is not None:
            fb.input_embeds = self.vision.input_embeds(plan)
        if plan.hidden_rows:
            rows = plan.hidden_rows
            fb.hidden_rows = torch.tensor(rows, dtype=torch.long, device=fb.input_ids.device)
        return fb

    def _sample_first_tokens(self, to_sample: list[tuple[Req, int]], logits: torch.Tensor) -> None:
        rows = torch.tensor([row for _, row in to_sample], device=logits.device)
        reqs = [req for req, _ in to_sample]
        self.sampler.sample_and_append(reqs, logits.index_select(0, rows))
        for req in reqs:
            if not req.finished:
                self.table.move(req, ReqStatus.RUNNING)
