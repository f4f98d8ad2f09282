"""The scheduler: continuous batching over the paged KV pool with the radix cache.

Each `step()` runs one forward pass: a prefill (EXTEND) of newly admitted requests' uncached
suffixes when there is anything to admit, else a DECODE of every running request. Requests join
and leave at every step. A step is schedule (which requests, how many tokens each), run (lay the
batch out: `prefill.py`, or the decode step in `decode.py`, with `drafts.py` when drafts ride
along; one forward), sample, then postprocess (`output.py`: text, stops, finishing, the
increments sent back).

Invariants (checked by `check_invariants`):
- pool free slots + slots owned by the radix cache + slots owned by requests == pool capacity;
- a request's `kv_slots[:cached_len]` are in the cache and locked through `last_node`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

import torch

from sglite.runtime.cache.factory import build_cache
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.tiered_cache import TieredRadixCache
from sglite.runtime.cache.tree_view import snapshot_tree
from sglite.runtime.constrained import GrammarError, GrammarManager, create_backend
from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.loader import LoadedModel
from sglite.runtime.multimodal.processor import is_pad
from sglite.runtime.multimodal.spec import vision_spec
from sglite.runtime.multimodal.vision_encoder import VisionEncoder
from sglite.runtime.sampling.sampler import Sampler
from sglite.runtime.scheduler.decode import DecodeManager
from sglite.runtime.scheduler.disaggregation import COUNTERS as PD_COUNTERS
from sglite.runtime.scheduler.disaggregation import build_disaggregation
from sglite.runtime.scheduler.drafts import RetokenizingJump
from sglite.runtime.scheduler.grammar import GrammarQueue, apply_grammar_masks
from sglite.runtime.scheduler.io import GenerateInput, RequestOutput
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.output import OutputProcessor, TopLogprobs, abort_reason
from sglite.runtime.scheduler.policy import order_waiting, shares_with_batch
from sglite.runtime.scheduler.prefill import PrefillBatch, collect_input_logprobs
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.segments import SegmentAssembler
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
            args.grammar_backend, self.tokenizer, self.config.vocab_size, self.eos_token_ids
        )
        self.grammars = GrammarQueue(GrammarManager(backend), args.grammar_compile_timeout)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the one request whose prompt is partly prefilled
        self.prefilling: list[Req] = []  # admitted by this step's prefill, not yet running
        self.new_token_ratio = args.init_new_token_ratio
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
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_verify_passes": 0,
            **dict.fromkeys(PD_COUNTERS, 0),
            "segment_reused_tokens": 0,
        }
        self.output = OutputProcessor(self.kv, self.eos_token_ids, self.context_len, self.counters)
        # None, "exact" or "retokenize" (see scheduler/drafts.py).
        self.jump_forward = None if args.disable_jump_forward else args.jump_forward_mode
        self.decode = DecodeManager(self, loaded, capacity)  # drafts and speculation too
        spec = vision_spec(loaded.model_path)
        self.vision: VisionEncoder | None = None
        if spec is not None:
            self.vision = VisionEncoder(spec, self.device, args.vision_cache_images)
        self.retokenizer: RetokenizingJump | None = None
        if self.jump_forward == "retokenize":
            encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)
            self.retokenizer = RetokenizingJump(encode, self.counters)
        # Disaggregated prefill/decode (`--disaggregation-mode`): None when off.
        self.disagg = build_disaggregation(self)
        self.segments = SegmentAssembler(self, args.segment_recompute_fraction)

    # ------------------------------------------------------------------ intake
    def add_request(self, inp: GenerateInput) -> None:
        """Queue a request; invalid ones finish at once with an abort reason naming the problem."""
        req = Req.from_input(inp, self.tokenizer, self.device)
        problem = self._admission_problem(req)
        if problem:
            self.output.abort(req, problem)
            return
        if req.return_logprob and req.logprob_start_len >= 0:
            req.logprob_start_len = min(req.logprob_start_len, len(req.prompt_ids) - 1)
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        if req.params.constraint is None:
            self._enqueue(req)
            return
        try:
            self.grammars.add(req, req.params.constraint)
        except GrammarError as exc:
            self.output.abort(req, str(exc))

    def _admit_compiled_grammars(self) -> None:
        """Queue requests whose grammar compiled; fail those whose grammar did not."""
        if not self.grammars.pending:
            return
        ready, failed = self.grammars.poll()
        for req in ready:
            self._enqueue(req)
        for req, message in failed:
            self.output.abort(req, message)

    def _enqueue(self, req: Req) -> None:
        """Queue a request to be prefilled here, unless a decode server pulls its KV instead or
        it is assembled from cached segments."""
        if self.segments.admit(req):
            return
        if self.disagg is None or not self.disagg.admit(req):
            self.waiting.append(req)

    def _admission_problem(self, req: Req) -> str | None:
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if not req.prompt_ids:
            return "the prompt is empty"
        if req.segments:
            problem = self.segments.unsupported(req, self.cache_enabled, self.disagg is not None)
            if problem:
                return problem
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
                    self.output.abort(req, message)
                    return
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self.output.abort(req, message)
            return
        compiling = self.grammars.remove(rid)
        if compiling is not None:
            self.output.abort(compiling, message)
            return
        transferring = self.disagg.remove(rid) if self.disagg is not None else None
        if transferring is not None:
            self.output.abort(transferring, message)
            return
        assembling = self.segments.remove(rid)
        if assembling is not None:
            self.output.abort(assembling, message)

    @property
    def has_work(self) -> bool:
        """True when a step would do something."""
        return (
            bool(self.waiting or self.running or self.chunked or self.grammars.pending)
            or self.segments.busy
        )

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one forward pass (prefill if anything can be admitted, else decode)."""
        self._admit_compiled_grammars()
        # Logits are inference tensors; masking and sampling them in place needs this mode too.
        with torch.inference_mode():
            if self.segments.busy and self.segments.run_one():
                return self.collect_outputs()
            prefill = self._schedule_prefill()
            if prefill:
                # Admitted requests are in neither `waiting` nor `running` until the pass ends;
                # `fail_all` finds them here if it raises.
                self.prefilling = [req for req, _ in prefill]
                self._run_prefill(prefill)
                self.prefilling = []
            elif self.running:
                self.decode.run()
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
            if not self.kv.can_fit(n, self.reserved_tokens()):
                self.retract(req)
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
        reserved = self.reserved_tokens()
        for req in ordered:
            if budget <= 0 or len(self.running) + len(batch) >= self.args.max_running_requests:
                break
            matched = self.kv.match_and_lock(req)
            if shares_with_batch(req, matched, batch):
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

    def reserved_tokens(self) -> int:
        """Slots kept free for the expected output of running requests."""
        pending = sum(r.remaining_new_tokens for r in self.running)
        return int(pending * self.new_token_ratio)

    # ------------------------------------------------------------------ prefill
    def _run_prefill(self, batch: list[tuple[Req, int]]) -> None:
        """Compute the admitted chunks; requests whose prompt is now complete start running."""
        plan = PrefillBatch.plan(batch)
        fb = ForwardBatch.build(
            ForwardMode.EXTEND,
            plan.token_ids,
            plan.prefix_lens,
            [req.kv_slots for req, _ in batch],
            plan.logit_rows,
            self.device,
        )
        if self.vision is not None:
            fb.input_embeds = self.vision.input_embeds(plan)
        if plan.hidden_rows:
            rows = plan.hidden_rows
            fb.hidden_rows = torch.tensor(rows, dtype=torch.long, device=fb.input_ids.device)
        start_time = time.perf_counter()
        logits = self.forward(fb)
        for item in plan.items:
            if item.req.pooling is not None and fb.hidden is not None:
                item.req.pooling.add(fb.hidden[item.hidden[0] : item.hidden[1]])
        self.kv.observe_prefill(plan.num_tokens, time.perf_counter() - start_time)
        self.counters["prefill_passes"] += 1
        self.counters["prefill_tokens_computed"] += plan.num_tokens
        to_sample: list[tuple[Req, int]] = []
        for item in plan.items:
            req = item.req
            if req.wants_input_logprobs:
                collect_input_logprobs(item, logits, self.sampler)
            done = len(req.kv_slots) == req.num_fill
            if not done:
                self.kv.cache_unfinished(req)
                if self.disagg is not None:
                    self.disagg.prefilled_chunk(req)
                continue
            if self.chunked is req:
                self.chunked = None
            req.input_logprobs_done = True
            if req.params.max_new_tokens == 0:
                self.output.finish(req, {"type": "length", "length": 0})
                continue
            self.kv.cache_unfinished(req)
            to_sample.append((req, item.last_row))
        if to_sample:
            rows_t = torch.tensor([row for _, row in to_sample], device=logits.device)
            self.sample_and_append([req for req, _ in to_sample], logits.index_select(0, rows_t))
            for req, _ in to_sample:
                if not req.finished:
                    self.running.append(req)

    def retract(self, req: Req) -> None:
        """Send a request back to the queue; its computed tokens stay in the cache."""
        self.counters["retractions"] += 1
        if not req.input_logprobs_done:  # recomputed from logprob_start_len on re-admission
            req.input_logprobs_pending, req.input_top_pending = [], []
        if req.pooling is not None:  # its prompt is computed again from the cached prefix
            req.pooling = type(req.pooling)(req.pooling.mode)
        self.kv.release(req)  # KV past exact_len (assembled from segments) is dropped...
        req.segments, req.exact_len = [], None  # ... and recomputed exactly on re-admission
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ sampling & finishing
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.counters["forward_passes"] += 1
        if self.tp.enabled:
            self.tp.broadcast_object(fb)
        return self.model(fb, self.pool)

    def stop_followers(self) -> None:
        """Tell the other tensor-parallel ranks to exit (they wait in a broadcast)."""
        if self.tp.enabled:
            self.tp.broadcast_object(None)

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample row i of `logits` for reqs[i] and append it; a request whose own part fails
        (grammar, NaN logits, detokenizing) ends alone."""
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
                self.fail_request(req, failed[i])
                continue
            tok = result.next_token_ids[i]
            top = result.top_logprobs[i] if result.top_logprobs else None
            try:
                self._append_sampled(req, tok, result.logprobs[i], top)
            except Exception as exc:
                self.fail_request(req, exc)

    def _append_sampled(
        self, req: Req, tok: int, logprob: float | None, top: TopLogprobs | None
    ) -> None:
        """Append a token the model chose; in retokenize mode, then the forced text after it.
        On a prefill server a bootstrapped request's first token ends it here (its KV goes to
        the decode server)."""
        if self.disagg is not None and self.disagg.takes_token(req):
            self.disagg.append_first_token(req, tok, logprob, top)
            return
        self.output.append_token(req, tok, logprob, top)
        if self.retokenizer is not None and req.grammar is not None and not req.finished:
            self.retokenizer.jump(req, lambda r, t: self.output.append_token(r, t, None, None))

    def fail_request(self, req: Req, exc: BaseException) -> None:
        """End one request whose own work (grammar, detokenizing, stop check) raised; the rest
        of the batch goes on. Model failures are batch-wide and end in `fail_all` instead."""
        logger.error("request %s failed", req.rid, exc_info=exc)
        message = f"internal error while generating this request: {type(exc).__name__}: {exc}"
        try:
            self.output.abort(req, message)
        except Exception:  # its state may be half-updated; answer it anyway
            req.finish_reason = abort_reason(message)
            self.output.publish(req)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an abort after a failed step; the loop keeps serving.

        KV written by the failed pass cannot be trusted, so requests' own slots are freed
        uncached (`RequestKVManager.discard`); prefixes already in the cache stay valid.
        """
        reqs = self.waiting + self.running + ([self.chunked] if self.chunked else [])
        reqs += self.grammars.pending + self.prefilling + self.segments.take_pending()
        self.waiting, self.running, self.chunked, self.grammars.pending = [], [], None, []
        self.prefilling = []
        if self.decode.speculator is not None:
            self.decode.speculator.forget(set())
        seen: set[int] = set()
        for req in reqs:
            if id(req) in seen or req.finished:
                continue
            seen.add(id(req))
            req.finish_reason = abort_reason(message)
            self.counters["aborted_requests"] += 1
            try:
                self.kv.discard(req)
                req.sampling.release()
            except Exception:  # state may be inconsistent after the failure; still answer
                logger.exception("releasing %s after a failed step", req.rid)
            self.output.publish(req)
        return self.collect_outputs()

    def collect_outputs(self) -> list[RequestOutput]:
        """The increments of every request that changed since the last call (see
        `OutputProcessor.collect` for when a non-streamed request's are held back)."""
        outs = self.segments.filter_outputs(self.output.collect())
        if self.disagg is not None:
            self.disagg.ended(outs)
        return outs

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> None:
        """Empty the radix cache; refused while requests are in flight."""
        if self.has_work or (self.disagg is not None and self.disagg.busy):
            raise RuntimeError("cannot flush the cache while requests are running or queued")
        self.cache.flush()
        if self.decode.speculator is not None:
            self.decode.speculator.flush()
        if self.vision is not None:
            self.vision.flush()

    def check_invariants(self) -> dict[str, int]:
        """Verify slot accounting; raises AssertionError naming the broken invariant."""
        holders = list(self.running) + ([self.chunked] if self.chunked else [])
        if self.disagg is not None:
            holders += self.disagg.holders()
        if self.decode.speculator is not None:
            self.decode.speculator.check_invariants()
        return self.kv.check_invariants(holders)

    def cache_tree(self, depth: int, max_nodes: int, text_tokens: int) -> dict[str, Any]:
        """A bounded snapshot of the radix tree (`cache/tree_view.py`) with the path the latest
        admitted request matched, and the live statistics (`info`)."""
        rid, node, matched, prompt = self.kv.last_admission or (None, None, 0, 0)
        decode = lambda ids: _decode_span(self.tokenizer, ids)
        tree = snapshot_tree(
            self.cache,
            decode,
            depth=depth,
            max_nodes=max_nodes,
            text_tokens=text_tokens,
            highlight=node,
        )
        last = {"rid": rid, "cached_tokens": matched, "prompt_tokens": prompt} if rid else None
        return {**tree, "last_request": last, "stats": self.info()}

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
            "evicted_tokens": stats.evicted_tokens,
            "queried_prompt_tokens": stats.queried_tokens,
            "new_token_ratio": self.new_token_ratio,
            **self.counters,
            **self._tier_info(),
            **self._speculation_info(),
            **(self.vision.info() if self.vision is not None else {}),
            **(self.disagg.info() if self.disagg is not None else {}),
        }

    def _speculation_info(self) -> dict[str, Any]:
        speculator, costs = self.decode.speculator, self.decode.spec_costs
        return {
            **(speculator.info() if speculator is not None else {}),
            **({"speculative_costs": costs.info()} if costs is not None else {}),
        }

    def _tier_info(self) -> dict[str, Any]:
        """Per-tier sizes and counters of the hierarchical cache (docs/hicache.md)."""
        if not isinstance(self.cache, TieredRadixCache):
            return {}
        return {"hicache": self.cache.tier_info(), "hicache_costs": self.cache.costs.snapshot()}


def _decode_span(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A tree node's text: its tokens decoded, each run of image positions (pad ids,
    multimodal/processor.py) shown as `[image]`."""
    return "".join(
        "[image]" if pad else tokenizer.decode(list(run))
        for pad, run in itertools.groupby(ids, key=is_pad)
    )
