"""The scheduler: continuous batching over the paged KV pool with the radix cache.

Each `step()` runs one forward pass: a prefill (EXTEND) of newly admitted requests' uncached
suffixes when there is anything to admit, else a DECODE of every running request. Requests join
and leave at every step.

Invariants (checked by `check_invariants`):
- pool free slots + slots owned by the radix cache + slots owned by requests == pool capacity;
- a request's `kv_slots[:cached_len]` are in the cache and locked through `last_node`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from sglite.runtime.cache.factory import build_cache
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.tiered_cache import TieredRadixCache
from sglite.runtime.constrained import GrammarError, GrammarManager, create_backend
from sglite.runtime.detokenizer import IncrementalDetokenizer, StopChecker
from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.loader import LoadedModel
from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.sampling.sampler import Sampler, SamplingInfo
from sglite.runtime.scheduler.grammar import (
    GrammarQueue,
    apply_grammar_masks,
    exact_draft,
    retokenized_forced_tokens,
)
from sglite.runtime.scheduler.io import GenerateInput, RequestOutput
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.policy import order_waiting
from sglite.runtime.scheduler.pooling import Pooling
from sglite.runtime.scheduler.request import Req
from sglite.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Requests sharing at least this many uncached tokens with one admitted in the same step wait one
# step, so they hit the cache instead of computing the shared part again.
IN_BATCH_SHARING_MIN_TOKENS = 32


def default_pool_capacity(loaded: LoadedModel, context_len: int) -> int:
    """KV pool size in tokens: 15% of RAM (or of GPU memory), at most 128k, at least one context."""
    cfg = loaded.config
    per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    if torch.device(loaded.device).type == "cuda":
        total = torch.cuda.get_device_properties(torch.device(loaded.device)).total_memory
        budget = int(total * 0.3)
    else:
        budget = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.15)
    return max(min(budget // per_token, 131072), min(context_len, 131072))


class Scheduler:
    """Owns the model, KV pool, radix cache and queues; `step()` advances every request."""

    def __init__(
        self, args: ServerArgs, loaded: LoadedModel, tp: TensorParallelGroup = SINGLE
    ) -> None:
        self.args = args
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.device = torch.device(loaded.device)
        # Tensor-parallel rank 0: every forward is first broadcast to the other ranks.
        self.tp = tp
        self.context_len = args.context_length or self.config.max_position_embeddings
        capacity = args.max_total_tokens or default_pool_capacity(loaded, self.context_len)
        capacity = tp.broadcast_object(capacity)  # every rank's pool has rank 0's slot count
        self.pool = KVPool(
            capacity,
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            loaded.dtype,
            self.device,
        )
        self.cache = build_cache(args, self.pool, loaded)
        self.cache_enabled = not args.disable_radix_cache
        self.kv = RequestKVManager(
            self.pool, self.cache, self.cache_enabled, args.min_cached_prefix
        )
        self.sampler = Sampler(self.config.vocab_size, self.device)
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        backend = create_backend(
            args.grammar_backend, self.tokenizer.hf, self.config.vocab_size, self.eos_token_ids
        )
        self.grammars = GrammarQueue(GrammarManager(backend), args.grammar_compile_timeout)
        # None, "exact" or "retokenize" (see scheduler/grammar.py).
        self.jump_forward = None if args.disable_jump_forward else args.jump_forward_mode
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the one request whose prompt is partly prefilled
        self.prefilling: list[Req] = []  # admitted by this step's prefill, not yet running
        self.new_token_ratio = args.init_new_token_ratio
        self.outbox: dict[str, Req] = {}
        self.counters: dict[str, int] = {
            "forward_passes": 0,
            "prefill_passes": 0,
            "decode_passes": 0,
            "retractions": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "finished_requests": 0,
            "aborted_requests": 0,
            "jump_forward_drafted_tokens": 0,
            "jump_forward_accepted_tokens": 0,
        }

    # ------------------------------------------------------------------ intake
    def add_request(self, inp: GenerateInput) -> None:
        """Queue a request; invalid ones finish at once with an abort reason naming the problem."""
        params = SamplingParams.from_dict(inp.sampling_params)
        req = Req(
            rid=inp.rid,
            prompt_ids=list(inp.input_ids),
            params=params,
            sampling=SamplingInfo.create(params, list(inp.input_ids), self.device),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                # Context so SentencePiece-style tokenizers keep the first output's leading space.
                prompt_ids=inp.input_ids,
            ),
            stop_checker=StopChecker(params.stop, params.stop_regex),
            arrival_time=inp.arrival_time or time.monotonic(),
            return_logprob=inp.return_logprob,
            logprob_start_len=inp.logprob_start_len,
            top_logprobs_num=inp.top_logprobs_num,
            stream=inp.stream,
            pooling=Pooling(inp.pooling) if inp.pooling else None,
        )
        problem = self._admission_problem(req)
        if problem:
            self._finish(req, {"type": "abort", "message": problem})
            return
        if req.return_logprob and req.logprob_start_len >= 0:
            req.logprob_start_len = min(req.logprob_start_len, len(req.prompt_ids) - 1)
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        if params.constraint is None:
            self.waiting.append(req)
            return
        try:
            self.grammars.add(req, params.constraint)
        except GrammarError as exc:
            self._finish(req, {"type": "abort", "message": str(exc)})

    def _admit_compiled_grammars(self) -> None:
        """Queue requests whose grammar compiled; fail those whose grammar did not."""
        if not self.grammars.pending:
            return
        ready, failed = self.grammars.poll()
        self.waiting.extend(ready)
        for req, message in failed:
            self._finish(req, {"type": "abort", "message": message})

    def _admission_problem(self, req: Req) -> str | None:
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if not req.prompt_ids:
            return "the prompt is empty"
        if len(req.prompt_ids) >= self.context_len:
            return (
                f"the prompt has {len(req.prompt_ids)} tokens, more than the context length "
                f"({self.context_len}) allows"
            )
        if total > self.pool.capacity:
            return (
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) exceeds the KV pool ({self.pool.capacity} tokens)"
            )
        return None

    def abort(self, rid: str, message: str) -> None:
        """Finish a request wherever it is; its slots go back to the pool or the cache."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, {"type": "abort", "message": message})
                    return
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._finish(req, {"type": "abort", "message": message})
            return
        compiling = self.grammars.remove(rid)
        if compiling is not None:
            self._finish(compiling, {"type": "abort", "message": message})

    @property
    def has_work(self) -> bool:
        """True when a step would do something."""
        return bool(self.waiting or self.running or self.chunked or self.grammars.pending)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one forward pass (prefill if anything can be admitted, else decode)."""
        self._admit_compiled_grammars()
        # Logits are inference tensors; masking and sampling them in place needs this mode too.
        with torch.inference_mode():
            prefill = self._schedule_prefill()
            if prefill:
                # Admitted requests are in neither `waiting` nor `running` until the pass ends;
                # `fail_all` finds them here if it raises.
                self.prefilling = [req for req, _ in prefill]
                self._run_prefill(prefill)
                self.prefilling = []
            elif self.running:
                self._run_decode()
            elif self.grammars.pending:
                time.sleep(0.001)  # only grammars compiling (on worker threads): do not spin
        return self.collect_outputs()

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        # New tokens in the whole batch: a longer prompt is prefilled in chunks (as SGLang,
        # both limits bound the batch).
        budget = min(self.args.chunked_prefill_size, self.args.max_prefill_tokens)
        batch: list[tuple[Req, int]] = []
        if self.chunked is not None:
            req = self.chunked
            n = min(budget, req.num_fill - len(req.kv_slots))
            if not self.kv.can_fit(n, self._reserved_tokens()):
                self._retract(req)
                self.chunked = None
            else:
                req.kv_slots.extend(self.kv.alloc(n))
                batch.append((req, n))
                budget -= n
        if not self.waiting:
            return batch
        now = time.monotonic()
        cache = self.cache if self.cache_enabled else None
        ordered = order_waiting(
            self.waiting, self.args.schedule_policy, cache, now, self.args.starvation_timeout
        )
        reserved = self._reserved_tokens()
        for req in ordered:
            if budget <= 0 or len(self.running) + len(batch) >= self.args.max_running_requests:
                break
            matched = self.kv.match_and_lock(req)
            if self._shares_with_batch(req, matched, batch):
                self.kv.unlock(req)
                continue
            extend = req.num_fill - matched
            n = min(extend, budget)
            if n < extend and self.chunked is not None:
                self.kv.unlock(req)
                break
            own_reserve = int(req.remaining_new_tokens * self.new_token_ratio)
            if not self.kv.can_fit(n, reserved + own_reserve):
                self.kv.unlock(req)
                break
            reserved += own_reserve
            req.kv_slots.extend(self.kv.alloc(n))
            self.waiting.remove(req)
            if not req.admitted_once:
                req.cached_tokens = matched
                req.admitted_once = True
                self.cache.record_query(len(req.prompt_ids), matched)
                self.kv.record_admission(req)
            if n < extend:
                self.chunked = req
            batch.append((req, n))
            budget -= n
        return batch

    @staticmethod
    def _shares_with_batch(req: Req, matched: int, batch: list[tuple[Req, int]]) -> bool:
        span = IN_BATCH_SHARING_MIN_TOKENS
        if req.num_fill - matched <= span:
            return False
        window = req.fill_ids[matched : matched + span]
        for other, _ in batch:
            if other.cached_len <= matched and other.fill_ids[matched : matched + span] == window:
                return True
        return False

    def _reserved_tokens(self) -> int:
        """Slots kept free for the expected output of running requests."""
        pending = sum(r.remaining_new_tokens for r in self.running)
        return int(pending * self.new_token_ratio)

    # ------------------------------------------------------------------ prefill
    def _run_prefill(self, batch: list[tuple[Req, int]]) -> None:
        token_ids, prefix_lens, logit_rows, hidden_rows = [], [], [], []
        row_plan: list[tuple[int, int, int]] = []  # per request: (first row, first position, n)
        hidden_plan: list[tuple[int, int]] = []  # per request: its rows of the hidden states
        offset = 0
        for req, n in batch:
            start = len(req.kv_slots) - n
            token_ids.append(req.fill_ids[start : start + n])
            prefix_lens.append(start)
            row_plan.append((len(logit_rows), start, n))
            logit_rows.extend(offset + i for i in self._logit_positions(req, start, n))
            pooled = req.pooling.offsets(start, n, req.num_fill) if req.pooling else []
            hidden_plan.append((len(hidden_rows), len(hidden_rows) + len(pooled)))
            hidden_rows.extend(offset + i for i in pooled)
            offset += n
        fb = ForwardBatch.build(
            ForwardMode.EXTEND,
            token_ids,
            prefix_lens,
            [req.kv_slots for req, _ in batch],
            logit_rows,
            self.device,
        )
        if hidden_rows:
            fb.hidden_rows = torch.tensor(hidden_rows, dtype=torch.long, device=fb.input_ids.device)
        start_time = time.perf_counter()
        logits = self._forward(fb)
        for (req, _), (lo, hi) in zip(batch, hidden_plan, strict=True):
            if req.pooling is not None and fb.hidden is not None:
                req.pooling.add(fb.hidden[lo:hi])
        self.kv.observe_prefill(offset, time.perf_counter() - start_time)
        self.counters["prefill_passes"] += 1
        to_sample: list[tuple[Req, int]] = []
        for (req, n), (first_row, start, _) in zip(batch, row_plan):
            rows = self._logit_positions(req, start, n)
            if req.wants_input_logprobs:
                self._collect_input_logprobs(req, start, n, logits, first_row, rows)
            done = len(req.kv_slots) == req.num_fill
            if not done:
                self.kv.cache_unfinished(req)
                continue
            if self.chunked is req:
                self.chunked = None
            req.input_logprobs_done = True
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            self.kv.cache_unfinished(req)
            to_sample.append((req, first_row + len(rows) - 1))
        if to_sample:
            rows_t = torch.tensor([row for _, row in to_sample], device=logits.device)
            self._sample_and_append([req for req, _ in to_sample], logits.index_select(0, rows_t))
            for req, _ in to_sample:
                if not req.finished:
                    self.running.append(req)

    def _logit_positions(self, req: Req, start: int, n: int) -> list[int]:
        """Offsets (within this chunk) whose logits are needed: input logprobs and the last."""
        rows: list[int] = []
        if req.wants_input_logprobs:
            lo = max(start, req.logprob_start_len)
            hi = min(start + n, len(req.prompt_ids) - 1)
            rows.extend(p - start for p in range(lo, hi))
        end = start + n
        if end == req.num_fill and req.params.max_new_tokens > 0:
            rows.append(n - 1)
        return rows

    def _collect_input_logprobs(
        self, req: Req, start: int, n: int, logits: torch.Tensor, first_row: int, rows: list[int]
    ) -> None:
        prompt = req.prompt_ids
        s = req.logprob_start_len
        if start <= s < start + n:
            req.input_logprobs_pending.append((None, prompt[s]))
            req.input_top_pending.append(None)
        positions = [start + r for r in rows if start + r < len(prompt) - 1]
        if not positions:
            return
        sub = logits[first_row : first_row + len(positions)]
        targets = torch.tensor([prompt[p + 1] for p in positions], device=sub.device)
        values, tops = self.sampler.logprobs_of(sub, targets, req.top_logprobs_num)
        for i, p in enumerate(positions):
            req.input_logprobs_pending.append((values[i], prompt[p + 1]))
            req.input_top_pending.append(tops[i] if tops is not None else None)

    # ------------------------------------------------------------------ decode
    def _run_decode(self) -> None:
        drafts = self._plan_drafts()
        self._make_room_for_decode(drafts)
        if not self.running:
            return
        reqs = list(self.running)
        if drafts or any(r.num_fill - len(r.kv_slots) > 1 for r in reqs):
            self._run_decode_extend(reqs, drafts)
        else:
            for req in reqs:
                req.kv_slots.extend(self.kv.alloc(1))
            fb = ForwardBatch.build(
                ForwardMode.DECODE,
                [[req.output_ids[-1]] for req in reqs],
                [len(req.kv_slots) - 1 for req in reqs],
                [req.kv_slots for req in reqs],
                list(range(len(reqs))),
                self.device,
                slot_tensors=[req.slot_mirror.view(req.kv_slots) for req in reqs],
            )
            logits = self._forward(fb)
            self._sample_and_append(reqs, logits)
        self.counters["decode_passes"] += 1
        self.running = [r for r in self.running if not r.finished]
        self.new_token_ratio = max(
            self.args.min_new_token_ratio, self.new_token_ratio - self.args.new_token_ratio_decay
        )

    def _plan_drafts(self) -> dict[str, list[int]]:
        """Exact jump-forward: each constrained request's forced tokens, to verify this step."""
        if self.jump_forward != "exact":
            return {}
        drafts = {}
        for req in self.running:
            try:
                draft = exact_draft(req, self.context_len)
            except Exception as exc:
                self._fail_request(req, exc)
                continue
            if draft:
                drafts[req.rid] = draft
        self.running = [r for r in self.running if not r.finished]
        return drafts

    def _run_decode_extend(self, reqs: list[Req], drafts: dict[str, list[int]]) -> None:
        """A decode step as one EXTEND: each request computes its tokens without K/V (one, or
        more after a retokenizing jump) plus its draft; logits at the last of those and at every
        draft token, so the draft is verified in this same forward."""
        token_ids, prefix_lens, logit_rows = [], [], []
        plan: list[tuple[Req, list[int], int, int]] = []  # req, draft, kv kept, first logit row
        offset = 0
        for req in reqs:
            draft = drafts.get(req.rid, [])
            start = len(req.kv_slots)
            pending = req.fill_ids[start:]
            req.kv_slots.extend(self.kv.alloc(len(pending) + len(draft)))
            token_ids.append(pending + draft)
            prefix_lens.append(start)
            plan.append((req, draft, start + len(pending), len(logit_rows)))
            last = offset + len(pending) - 1
            logit_rows.extend(range(last, last + len(draft) + 1))
            offset += len(pending) + len(draft)
        fb = ForwardBatch.build(
            ForwardMode.EXTEND,
            token_ids,
            prefix_lens,
            [req.kv_slots for req in reqs],
            logit_rows,
            self.device,
            slot_tensors=[req.slot_mirror.view(req.kv_slots) for req in reqs],
        )
        logits = self._forward(fb)
        plain = [(req, row) for req, draft, _, row in plan if not draft]
        if plain:
            rows = torch.tensor([row for _, row in plain], device=logits.device)
            self._sample_and_append([req for req, _ in plain], logits.index_select(0, rows))
        for req, draft, kept, row in plan:
            if draft:
                self._verify_draft(req, draft, kept, logits[row : row + len(draft) + 1])

    def _verify_draft(self, req: Req, draft: list[int], kept: int, logits: torch.Tensor) -> None:
        """Emit the model's own tokens position by position; keep draft tokens while they
        match (see scheduler/grammar.py for why this is exact). `logits[j]` predicts the token
        after draft[:j]; `req.kv_slots[kept:]` hold the draft's K/V."""
        spare = req.kv_slots[kept:]
        del req.kv_slots[kept:]
        req.jump_forward_drafted += len(draft)
        self.counters["jump_forward_drafted_tokens"] += len(draft)
        used = 0  # draft slots whose K/V now belong to an output token
        for j in range(len(draft) + 1):
            self._sample_and_append([req], logits[j : j + 1])
            accepted = j < len(draft) and req.output_ids[-1] == draft[j]
            if accepted:
                req.jump_forward_accepted += 1
                self.counters["jump_forward_accepted_tokens"] += 1
            if req.finished or not accepted:
                break
            req.kv_slots.append(spare[j])
            used += 1
        self.pool.free(spare[used:])

    def _make_room_for_decode(self, drafts: dict[str, list[int]]) -> None:
        """Drop drafts, then retract the least advanced requests, until every running request
        has slots for its tokens without K/V."""

        def need() -> int:
            own = sum(r.num_fill - len(r.kv_slots) for r in self.running)
            return own + sum(len(drafts.get(r.rid, ())) for r in self.running)

        if drafts and self.pool.num_free + self.cache.evictable_size() < need():
            drafts.clear()
        while self.pool.num_free + self.cache.evictable_size() < need():
            if self.chunked is not None:
                req, self.chunked = self.chunked, None
            elif len(self.running) > 1:
                req = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival_time))
                self.running.remove(req)
            else:
                raise RuntimeError("KV pool exhausted by a single request (capacity check failed)")
            self._retract(req)
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)

    def _retract(self, req: Req) -> None:
        """Send a request back to the queue; its computed tokens stay in the cache."""
        self.counters["retractions"] += 1
        if not req.input_logprobs_done:  # recomputed from logprob_start_len on re-admission
            req.input_logprobs_pending, req.input_top_pending = [], []
        if req.pooling is not None:  # its prompt is computed again from the cached prefix
            req.pooling = type(req.pooling)(req.pooling.mode)
        self.kv.release(req)
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ sampling & finishing
    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.counters["forward_passes"] += 1
        if self.tp.enabled:
            self.tp.broadcast_object(fb)
        return self.model(fb, self.pool)

    def stop_followers(self) -> None:
        """Tell the other tensor-parallel ranks to exit (they wait in a broadcast)."""
        if self.tp.enabled:
            self.tp.broadcast_object(None)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        failed = apply_grammar_masks(reqs, logits, self.config.vocab_size)
        result = self.sampler.sample(
            logits,
            [r.sampling for r in reqs],
            self.eos_token_ids,
            [r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            return_logprobs=[r.return_logprob for r in reqs],
        )
        for i in result.invalid_rows:
            failed.setdefault(i, FloatingPointError("the model's logits were NaN or all -inf"))
        for i, req in enumerate(reqs):
            if i in failed:
                self._fail_request(req, failed[i])
                continue
            tok = result.next_token_ids[i]
            top = result.top_logprobs[i] if result.top_logprobs else None
            try:
                self._append_token(req, tok, result.logprobs[i], top)
            except Exception as exc:
                self._fail_request(req, exc)

    def _fail_request(self, req: Req, exc: BaseException) -> None:
        """End one request whose own work (grammar, detokenizing, stop check) raised; the rest
        of the batch goes on. Model failures are batch-wide and end in `fail_all` instead."""
        logger.error("request %s failed", req.rid, exc_info=exc)
        message = f"internal error while generating this request: {type(exc).__name__}: {exc}"
        try:
            self._finish(req, {"type": "abort", "message": message})
        except Exception:  # its state may be half-updated; answer it anyway
            req.finish_reason = {"type": "abort", "message": message}
            self.outbox[req.rid] = req

    def _append_token(
        self, req: Req, tok: int, logprob: float | None, top: Any, forced: bool = False
    ) -> None:
        """Record a new output token and finish the request if it ends here. `forced` marks a
        token appended by retokenizing jump-forward (no logprob: the model did not choose it)."""
        req.output_ids.append(tok)
        req.sampling.on_token(tok)
        self.counters["generated_tokens"] += 1
        self.outbox[req.rid] = req
        if req.return_logprob:
            req.output_logprobs_pending.append((logprob, tok))
            req.output_top_pending.append(top or [])
        params = req.params
        if req.grammar is not None and not req.grammar.accept_token(tok):
            message = f"constrained decoding: the grammar rejected token {tok}"
            self._finish(req, {"type": "abort", "message": message})
        elif (tok in self.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
            if params.no_stop_trim:
                self._push_text(req, tok)
            self._finish(req, {"type": "stop", "matched": tok})
        elif self._push_text(req, tok):
            pass  # a stop string matched and finished the request
        elif req.grammar is not None and req.grammar.is_terminated():
            # Nothing but EOS may follow: the constrained output is complete.
            self._finish(req, {"type": "stop", "matched": self.eos_token_ids[0]})
        elif len(req.output_ids) >= params.max_new_tokens:
            self._finish(req, {"type": "length", "length": params.max_new_tokens})
        elif req.num_fill >= self.context_len:
            self._finish(req, {"type": "length", "length": len(req.output_ids)})
        elif self.jump_forward == "retokenize" and not forced and req.grammar is not None:
            self._retokenizing_jump(req)

    def _retokenizing_jump(self, req: Req) -> None:
        """SGLang's original jump-forward: append the forced text's own tokens unverified."""
        encode = lambda text: self.tokenizer.hf.encode(text, add_special_tokens=False)
        tokens = retokenized_forced_tokens(req, encode)
        req.jump_forward_drafted += len(tokens)
        req.jump_forward_accepted += len(tokens)
        self.counters["jump_forward_drafted_tokens"] += len(tokens)
        self.counters["jump_forward_accepted_tokens"] += len(tokens)
        for tok in tokens:
            if req.finished:
                break
            self._append_token(req, tok, None, None, forced=True)

    def _push_text(self, req: Req, tok: int) -> bool:
        """Detokenize `tok`; finish on a stop string. Returns True when a stop matched."""
        before = len(req.output_text)
        req.output_text += req.detokenizer.push([tok])
        match = req.stop_checker.check(req.output_text, before)
        if match is None:
            return False
        if not req.params.no_stop_trim:
            req.output_text = req.output_text[: match.cut]
        self._finish(req, {"type": "stop", "matched": match.matched})
        return True

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        if reason["type"] == "length":  # emit bytes held back waiting for a UTF-8 continuation
            req.output_text += req.detokenizer.flush()
        if reason["type"] == "abort":
            self.counters["aborted_requests"] += 1
        else:
            self.counters["finished_requests"] += 1
        self.kv.release(req)
        req.sampling.release()
        self.outbox[req.rid] = req

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an abort after a failed step; the loop keeps serving.

        KV written by the failed pass cannot be trusted, so requests' own slots are freed
        uncached (`RequestKVManager.discard`); prefixes already in the cache stay valid.
        """
        reqs = self.waiting + self.running + ([self.chunked] if self.chunked else [])
        reqs += self.grammars.pending + self.prefilling
        self.waiting, self.running, self.chunked, self.grammars.pending = [], [], None, []
        self.prefilling = []
        seen: set[int] = set()
        for req in reqs:
            if id(req) in seen or req.finished:
                continue
            seen.add(id(req))
            req.finish_reason = {"type": "abort", "message": message}
            self.counters["aborted_requests"] += 1
            try:
                self.kv.discard(req)
                req.sampling.release()
            except Exception:  # state may be inconsistent after the failure; still answer
                logger.exception("releasing %s after a failed step", req.rid)
            self.outbox[req.rid] = req
        return self.collect_outputs()

    # ------------------------------------------------------------------ outputs
    def collect_outputs(self) -> list[RequestOutput]:
        """The increments of every request that changed since the last call.

        A non-streamed request past its first token stays in the outbox until it finishes: its
        client needs only the whole answer, and a message per step costs the client process
        CPU time that the step's kernels want on a small machine.
        """
        outs, held = [], {}
        for rid, req in self.outbox.items():
            if req.stream or req.finished or req.sent_token_len == 0:
                outs.append(req.take_output())
            else:
                held[rid] = req
        self.outbox = held
        return outs

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> None:
        """Empty the radix cache; refused while requests are in flight."""
        if self.has_work:
            raise RuntimeError("cannot flush the cache while requests are running or queued")
        self.cache.flush()

    def check_invariants(self) -> dict[str, int]:
        """Verify slot accounting; raises AssertionError naming the broken invariant."""
        holders = list(self.running) + ([self.chunked] if self.chunked else [])
        return self.kv.check_invariants(holders)

    def info(self) -> dict[str, Any]:
        """Live statistics for get_server_info."""
        stats = self.cache.stats
        queried = max(1, stats.queried_tokens)
        used = self.pool.capacity - self.pool.num_free
        return {
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
            "num_queued_reqs": len(self.waiting),
            "max_total_num_tokens": self.pool.capacity,
            "num_free_slots": self.pool.num_free,
            "cache_size_tokens": self.cache.total_size(),
            "pool_usage": used / self.pool.capacity,
            "cache_hit_rate": stats.matched_tokens / queried,
            "cached_prompt_tokens": stats.matched_tokens,
            "queried_prompt_tokens": stats.queried_tokens,
            "new_token_ratio": self.new_token_ratio,
            **self.counters,
            **self._tier_info(),
        }

    def _tier_info(self) -> dict[str, Any]:
        """Per-tier sizes and counters of the hierarchical cache (docs/hicache.md)."""
        if not isinstance(self.cache, TieredRadixCache):
            return {}
        return {"hicache": self.cache.tier_info(), "hicache_costs": self.cache.costs.snapshot()}
