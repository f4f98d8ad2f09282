"""Reusable prompt segments: a document's KV reused wherever it appears in a prompt.

A request may mark spans of its prompt as segments (retrieved passages, tool outputs). Each
segment's KV is cached by content: computed once as a sequence of its own after the model's BOS
(an internal prefill-only request), it lives in the radix tree under `[BOS] + its tokens`, with
the tree's accounting, locks and eviction. A prompt is then assembled instead of prefilled:

1. its longest exact cached prefix is matched as usual;
2. every segment after that prefix is copied from its cached KV into the request's slots with
   its keys turned to their new positions (`model/repositioning.py`);
3. one forward pass computes the prompt after the exact prefix, narrowed after layer 1 (and,
   with `layerwise` selection, after each later layer) to the tokens that are not in a reused
   segment (the question, text between segments, the last token) and the reused tokens whose
   K/V moved most from the copied ones (`segment_selection.py`: CacheBlend's selection;
   `ceil(fraction x reused tokens)` of them per layer). A token dropped after layer i keeps its
   copied K/V in the later layers.

With `fraction = 1.0` nothing is dropped: a full prefill, the same logits as without segments;
with 0 the pass computes only the tokens outside reused segments. Below 1.0 the answer is
approximate; the request's KV past the first reused segment is never inserted into the tree (a
later exact match must not read it), and a retracted request is recomputed exactly.

Invariants: an internal fill request never reaches a client (`is_internal`); a request waits
here until every segment it reuses is fully cached, and holds no slots while it waits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode, build_rows
from sglite.runtime.model.repositioning import reposition
from sglite.runtime.scheduler.budget import KVBudget
from sglite.runtime.scheduler.io import GenerateInput, RequestOutput
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.model_runner import ModelRunner
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable
from sglite.runtime.scheduler.segment_selection import DeviationNarrowing, keep_counts
from sglite.runtime.scheduler.stats import SchedulerStats
from sglite.runtime.scheduler.token_sampler import TokenSampler
from sglite.runtime.tokenizer import Tokenizer

# Internal request ids start with a character no client id can (`check_request_ids` takes any
# string, but the HTTP layer and the Engine generate hex ids or take the client's text).
FILL_PREFIX = "\x00segment-fill:"


@dataclass(frozen=True)
class SegmentPlan:
    """What one assembly computes and copies (positions are prompt indices)."""

    exact: int  # tokens served by the exact-prefix match
    reused: list[tuple[int, int]]  # spans [start, end) copied from the segment cache
    rows: list[int]  # positions computed in the forward, ascending
    recomputed: int  # rows inside reused spans

    @property
    def reused_tokens(self) -> int:
        return sum(end - start for start, end in self.reused) - self.recomputed

    @property
    def computed_tokens(self) -> int:
        return len(self.rows) - self.recomputed


def reused_spans(segments: list[tuple[int, int]], exact: int) -> list[tuple[int, int]]:
    """The segments copied from the segment cache: those wholly after the exact prefix (a
    segment reaching into it is not reused: its tail is computed)."""
    return [(s, e) for s, e in segments if s >= exact and e > s]


def plan_assembly(
    num_prompt: int, exact: int, reused: list[tuple[int, int]], recompute: set[int]
) -> SegmentPlan:
    """The rows of a prompt of `num_prompt` tokens whose first `exact` are cached exactly and
    whose `reused` spans are copied: every other token, the positions in `recompute` (inside
    the spans), and the prompt's last token (its logits give the first output token)."""
    covered = {p for s, e in reused for p in range(s, e)}
    recomputed = recompute & covered
    if num_prompt - 1 in covered:
        recomputed.add(num_prompt - 1)
    rows = {p for p in range(exact, num_prompt) if p not in covered} | recomputed
    return SegmentPlan(exact, reused, sorted(rows), len(recomputed))


class SegmentAssembler:
    """Holds segmented requests (status `SEGMENTS`) until their segments are cached, then
    assembles them."""

    def __init__(
        self,
        fraction: float,
        selection: str,
        table: RequestTable,
        runner: ModelRunner,
        sampler: TokenSampler,
        kv: RequestKVManager,
        budget: KVBudget,
        stats: SchedulerStats,
        tokenizer: Tokenizer,
    ) -> None:
        self.fraction = fraction
        self.selection = selection
        self.table = table
        self.runner = runner
        self.sampler = sampler
        self.kv = kv
        self.cache = kv.cache
        self.budget = budget
        self.stats = stats
        self.tokenizer = tokenizer
        # A segment is cached after the BOS a prompt starts with (a sequence without it is not
        # what the model was trained on: its first token would become the attention sink).
        bos = tokenizer.bos_token_id
        self.lead: list[int] = [] if bos is None else [int(bos)]
        self.fills: set[str] = set()  # internal fill requests in flight

    # ------------------------------------------------------------------ intake
    def admit(self, req: Req) -> bool:
        """Take a request with segments (True: it waits in `SEGMENTS`, holding no slots, until
        they are cached); others go the usual way."""
        if not req.segments:
            return False
        self._fill(self._missing(req))
        return True

    def unsupported(self, req: Req, cache_enabled: bool, disaggregated: bool) -> str | None:
        """Why `req`'s segments cannot be served here, or None."""
        if not cache_enabled:
            return "segments need the radix cache (the server runs with --disable-radix-cache)"
        if req.images or disaggregated:
            return "segments are not supported with images or disaggregated serving"
        if self.runner.tp.enabled:  # other ranks only run broadcast forwards
            return "segments are not supported with tensor parallelism (--tp-size > 1)"
        if req.wants_input_logprobs:
            return "segments: prompt logprobs (logprob_start_len >= 0) need a full prefill"
        tables = self.runner.model.ropes.tables
        if any(table.spec.kind() == "longrope" for table in tables):
            return "segments are not supported for longrope models (angles depend on position)"
        return None

    def is_internal(self, rid: str) -> bool:
        return rid.startswith(FILL_PREFIX)

    def filter_outputs(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Drop the internal fill requests' outputs (and forget finished fills)."""
        if not self.fills:  # every step calls this: nothing to look at without fills in flight
            return outs
        kept = []
        for out in outs:
            if not self.is_internal(out.rid):
                kept.append(out)
            elif out.finish_reason is not None:
                self.fills.discard(out.rid)
        return kept

    @property
    def busy(self) -> bool:
        return self.table.count(ReqStatus.SEGMENTS) > 0

    # ------------------------------------------------------------------ assembling
    def run_one(self) -> bool:
        """Assemble the first pending request whose segments are all cached and for which the
        pool has room: one forward pass (True), or nothing to do (False)."""
        for req in self.table.with_status(ReqStatus.SEGMENTS):
            missing = self._missing(req)
            if missing:
                self._fill(missing)
                continue
            if self._assemble(req):
                return True
        return False

    def _segment_ids(self, req: Req) -> list[list[int]]:
        """Each segment's key in the cache: the lead, then its tokens."""
        return [self.lead + req.prompt_ids[s:e] for s, e in req.segments]

    def _missing(self, req: Req) -> list[list[int]]:
        ids = self._segment_ids(req)
        return [seg for seg in ids if len(self.cache.match_prefix(seg).slots) < len(seg)]

    def _fill(self, missing: list[list[int]]) -> None:
        """Queue a prefill-only request for each segment key in `missing` (those not cached
        whole; one request per distinct segment in flight)."""
        for ids in missing:
            # Named by content: requests sharing a passage share its one fill.
            digest = hashlib.blake2b(repr(ids).encode(), digest_size=12).hexdigest()
            rid = f"{FILL_PREFIX}{digest}"
            if rid in self.fills:
                continue
            fill = GenerateInput(rid, ids, {"max_new_tokens": 0}, stream=False)
            self.fills.add(rid)
            req = Req.from_input(fill, self.tokenizer, self.runner.device)
            self.table.add(req, ReqStatus.WAITING)

    def _assemble(self, req: Req) -> bool:
        kv, cache = self.kv, self.cache
        exact = kv.match_and_lock(req)
        need = len(req.prompt_ids) - exact
        if not kv.can_fit(need, self.budget.reserved_tokens() + self.budget.own_reserve(req)):
            kv.unlock(req)
            return False
        reused = reused_spans(req.segments, exact)
        self._alloc_and_copy(req, need, reused)
        covered = {p for start, end in reused for p in range(start, end)}
        plan = plan_assembly(
            len(req.prompt_ids), exact, reused, covered if self.fraction >= 1.0 else set()
        )
        req.cached_tokens, req.admitted_once = exact, True
        req.exact_len = plan.reused[0][0] if plan.reused else None
        cache.record_query(len(req.prompt_ids), exact)
        req.input_logprobs_done = True
        logits, selected = self._forward(req, plan, covered)
        recomputed = plan.recomputed + selected
        req.segment_counts = {
            "reused": len(covered) - recomputed,
            "recomputed": recomputed,
            "computed": plan.computed_tokens,
        }
        kv.record_admission(req)
        self.stats.prefill_tokens_computed += plan.computed_tokens + recomputed
        self.stats.segment_reused_tokens += len(covered) - recomputed
        self.stats.segment_recomputed_tokens += recomputed
        self.sampler.sample_and_append([req], logits)
        if not req.finished:
            self.table.move(req, ReqStatus.RUNNING)
        return True

    def _forward(self, req: Req, plan: SegmentPlan, covered: set[int]) -> tuple[torch.Tensor, int]:
        """The assembly's pass: the prompt's last logits, and how many reused tokens it
        recomputed per layer beyond `plan.rows` (on average; `segment_selection.py`). At
        fraction 0 or 1 (or with nothing reused) there is nothing to choose: the plan's rows,
        every token or none of the reused ones, in one scattered pass."""
        candidates = covered - {len(req.prompt_ids) - 1}
        if not 0.0 < self.fraction < 1.0 or not candidates:
            return self.runner.forward(self._rows_batch(req, plan.rows)), 0
        candidate = torch.zeros(len(req.prompt_ids), dtype=torch.bool)
        candidate[sorted(candidates)] = True
        counts = keep_counts(
            self.runner.pool.num_layers, len(candidates), self.fraction, self.selection
        )
        narrowing = DeviationNarrowing(candidate, counts)
        ids = req.prompt_ids[plan.exact :]
        batch = ForwardBatch.build(
            ForwardMode.EXTEND,
            [ids],
            [plan.exact],
            [req.kv_slots],
            [len(ids) - 1],
            self.runner.device,
        )
        logits = self.runner.forward_narrowing(batch, narrowing)
        return logits, narrowing.recomputed

    def _alloc_and_copy(self, req: Req, need: int, reused: list[tuple[int, int]]) -> None:
        """Give the request `need` slots after its exact prefix and copy each reused segment's
        cached K/V into them, keys turned to the segment's new place (the sources are locked:
        the allocation may evict)."""
        lead, cache = len(self.lead), self.cache
        sources = [cache.match_prefix(self.lead + req.prompt_ids[s:e]) for s, e in reused]
        for match in sources:
            cache.lock(match.node)
        try:
            req.kv_slots.extend(self.kv.alloc(need))
            for (start, end), match in zip(reused, sources, strict=True):
                src = list(match.slots)[lead : lead + end - start]
                dst = req.kv_slots[start:end]
                reposition(self.runner.pool, self.runner.model.ropes, src, dst, start - lead)
        finally:
            for match in sources:
                cache.unlock(match.node)

    def _rows_batch(self, req: Req, rows: list[int]) -> ForwardBatch:
        """The rows in one pass computed as a prefill computes them (`build_rows`): row p
        attends to the request's slots up to p."""
        table = req.slot_mirror.view(req.kv_slots)
        ids = [req.prompt_ids[p] for p in rows]
        return build_rows(ids, rows, table, [len(rows) - 1], self.runner.device)
