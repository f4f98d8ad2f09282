"""The scheduler: continuous batching over the paged KV pool with the radix cache.

Each `step()` runs one forward pass: a prefill (EXTEND) of newly admitted requests' uncached
suffixes when there is anything to admit, else a DECODE of every running request. Requests join
and leave at every step. A step is schedule (which requests, how many tokens each), run (lay the
batch out: `prefill.py`, or the decode step in `decode.py`, with `drafts.py` when drafts ride
along; one forward through `ModelRunner`), sample (`TokenSampler`), then postprocess
(`output.py`: text, stops, finishing, the increments sent back).

Every request the scheduler holds is in its `RequestTable` with one status
(`request_table.py`); the managers (decode, segments, disaggregation) get the table and the
collaborators they use, and change a request's status only through the table.

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
from sglite.runtime.constrained import GrammarError, GrammarManager, create_backend
from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.model.loader import LoadedModel
from sglite.runtime.multimodal.spec import vision_spec
from sglite.runtime.multimodal.vision_encoder import VisionEncoder
from sglite.runtime.sampling.sampler import Sampler
from sglite.runtime.scheduler.budget import KVBudget
from sglite.runtime.scheduler.decode import DecodeManager
from sglite.runtime.scheduler.disaggregation import DecodeIntake, Disaggregation, PrefillHandoff
from sglite.runtime.scheduler.drafts import RetokenizingJump
from sglite.runtime.scheduler.grammar import GrammarQueue
from sglite.runtime.scheduler.io import AbortKind, GenerateInput, RequestOutput, abort_reason
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.model_runner import ModelRunner
from sglite.runtime.scheduler.output import OutputProcessor
from sglite.runtime.scheduler.prefill_manager import PrefillManager
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable
from sglite.runtime.scheduler.scheduler_report import cache_tree, scheduler_info
from sglite.runtime.scheduler.segments import SegmentAssembler
from sglite.runtime.scheduler.speculators import build_speculator
from sglite.runtime.scheduler.stats import SchedulerStats
from sglite.runtime.scheduler.structure_closing import StructureCloser
from sglite.runtime.scheduler.token_sampler import TokenSampler
from sglite.runtime.server_args import ServerArgs

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
    """Owns the model run, the KV pool, the radix cache and the request table; `step()`
    advances every request."""

    def __init__(
        self, args: ServerArgs, loaded: LoadedModel, tp: TensorParallelGroup = SINGLE
    ) -> None:
        self.args = args
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.device = torch.device(loaded.device)
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
        self.stats = SchedulerStats()
        self.table = RequestTable()
        # Tensor-parallel rank 0: every forward is first broadcast to the other ranks.
        self.runner = ModelRunner(loaded.model, self.pool, tp, self.device, self.stats)
        self.cache = build_cache(args, self.pool, loaded)
        self.cache_enabled = not args.disable_radix_cache
        self.kv = RequestKVManager(
            self.pool, self.cache, self.cache_enabled, args.min_cached_prefix
        )
        self.budget = KVBudget(args, self.table, self.kv, self.stats)
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        backend = create_backend(
            args.grammar_backend, self.tokenizer, self.config.vocab_size, self.eos_token_ids
        )
        self.grammars = GrammarQueue(GrammarManager(backend), args.grammar_compile_timeout)
        self.output = OutputProcessor(
            self.kv, self.table, self.eos_token_ids, self.context_len, self.stats
        )
        # None, "exact" or "retokenize" (see scheduler/drafts.py).
        self.jump_forward = None if args.disable_jump_forward else args.jump_forward_mode
        # Disaggregated prefill/decode (`--disaggregation-mode`): None when off.
        self.disagg = self._build_disaggregation()
        self.sampler = TokenSampler(
            Sampler(self.config.vocab_size, self.device),
            self.config.vocab_size,
            self.eos_token_ids,
            self.output,
            StructureCloser(self.tokenizer, self.config.vocab_size, self.eos_token_ids),
            self.disagg if isinstance(self.disagg, PrefillHandoff) else None,
            self._build_retokenizer(),
        )
        cache = self.cache if self.cache_enabled else None
        self.decode = DecodeManager(  # drafts and speculation too
            args,
            self.table,
            self.runner,
            self.sampler,
            self.output,
            self.kv,
            self.budget,
            self.stats,
            build_speculator(args, loaded, self.context_len, capacity, cache),
            self.context_len if self.jump_forward == "exact" else None,
        )
        spec = vision_spec(loaded.model_path)
        self.vision: VisionEncoder | None = None
        if spec is not None:
            self.vision = VisionEncoder(spec, self.device, args.vision_cache_images)
        self.prefill = PrefillManager(
            args,
            self.table,
            self.runner,
            self.sampler,
            self.output,
            self.kv,
            self.budget,
            self.stats,
            self.vision,
            self.disagg,
        )
        self.segments = SegmentAssembler(
            args.segment_recompute_fraction,
            args.segment_selection,
            self.table,
            self.runner,
            self.sampler,
            self.kv,
            self.budget,
            self.stats,
            self.tokenizer,
        )
        # The weights' move into 2 MB pages (`run_background_work`; read after the speculator
        # is built: a draft model's weights join the target's move).
        self.huge_pages = loaded.huge_pages

    def _build_disaggregation(self) -> Disaggregation | None:
        mode = self.args.disaggregation_mode
        if mode == "prefill":
            return PrefillHandoff(self.args, self.pool, self.cache, self.output, self.stats)
        if mode == "decode":
            return DecodeIntake(
                self.args, self.kv, self.output, self.table, self.budget, self.stats
            )
        return None

    def _build_retokenizer(self) -> RetokenizingJump | None:
        if self.jump_forward != "retokenize":
            return None
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)
        return RetokenizingJump(encode, self.stats)

    # ------------------------------------------------------------------ intake
    def add_request(self, inp: GenerateInput) -> None:
        """Take a request; an invalid one finishes at once with an abort naming the problem."""
        req = Req.from_input(inp, self.tokenizer, self.device)
        if self.table.get(req.rid) is not None:
            self.output.abort(
                req, f"rid: a request with id {req.rid!r} is already running", AbortKind.REJECTED
            )
            return
        problem = self._admission_problem(req)
        if problem:
            self.output.abort(req, problem, AbortKind.REJECTED)
            return
        if req.return_logprob and req.logprob_start_len >= 0:
            req.logprob_start_len = min(req.logprob_start_len, len(req.prompt_ids) - 1)
        self.stats.prompt_tokens += len(req.prompt_ids)
        if req.params.constraint is None:
            self._enqueue(req)
            return
        try:
            self.grammars.add(req, req.params.constraint)
        except GrammarError as exc:
            self.output.abort(req, str(exc), AbortKind.REJECTED)
            return
        self.table.add(req, ReqStatus.GRAMMAR)

    def _admit_compiled_grammars(self) -> None:
        """Queue requests whose grammar compiled; fail those whose grammar did not."""
        compiling = self.table.with_status(ReqStatus.GRAMMAR)
        if not compiling:
            return
        ready, failed = self.grammars.poll(compiling)
        for req in ready:
            self._enqueue(req)
        for req, message in failed:
            self.output.abort(req, message, AbortKind.REJECTED)

    def _enqueue(self, req: Req) -> None:
        """Queue a request to be prefilled here, unless a decode server pulls its KV instead or
        it is assembled from cached segments."""
        status = ReqStatus.WAITING
        if self.segments.admit(req):
            status = ReqStatus.SEGMENTS
        elif self.disagg is not None and self.disagg.admit(req):
            status = ReqStatus.TRANSFER
        if req in self.table:
            self.table.move(req, status)
        else:
            self.table.add(req, status)

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

    def abort(self, rid: str, message: str, kind: AbortKind = AbortKind.CANCELLED) -> None:
        """Finish a request wherever it is; its slots go back to the pool or the cache."""
        req = self.table.get(rid)
        if req is None:
            return
        if self.table.status(req) is ReqStatus.TRANSFER and self.disagg is not None:
            self.disagg.remove(req)
        self.output.abort(req, message, kind)

    def abort_all(self, message: str, kind: AbortKind) -> None:
        """Finish every request in the table (the server is shutting down)."""
        for req in self.table:
            self.abort(req.rid, message, kind)

    @property
    def has_work(self) -> bool:
        """True when a step would do something (a request receiving its KV waits for the
        process loop's `disagg.poll`, not for a step)."""
        return len(self.table) > self.table.count(ReqStatus.TRANSFER)

    @property
    def has_background_work(self) -> bool:
        """True while `run_background_work` has something left to do."""
        return self.huge_pages is not None and self.huge_pages.pending

    def run_background_work(self) -> None:
        """One short piece of the work that serves no request, called between steps and while
        idle: the weights read into the process's memory moved into 2 MB pages (a piece takes
        2-20 ms). In this thread rather than beside the kernels' threads, which a moving
        thread would take a core from."""
        if self.huge_pages is not None:
            self.huge_pages.step()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One forward pass: schedule (admit grammars, then a prefill if anything can be
        admitted, else a decode), run it, and return the outputs it produced."""
        self._admit_compiled_grammars()
        # Logits are inference tensors; masking and sampling them in place needs this mode too.
        with torch.inference_mode():
            if self.segments.busy and self.segments.run_one():
                return self.collect_outputs()
            prefill = self.prefill.schedule()
            if prefill:
                self.prefill.run(prefill)
                self.decode.read_prompts([req for req, _ in prefill])
            elif self.table.count(ReqStatus.RUNNING):
                self.decode.run()
            elif self.table.count(ReqStatus.GRAMMAR):
                time.sleep(0.001)  # only grammars compiling (on worker threads): do not spin
        return self.collect_outputs()

    def stop_followers(self) -> None:
        """Tell the other tensor-parallel ranks to exit (they wait in a broadcast)."""
        self.runner.stop_followers()

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an abort after a failed step; the loop keeps serving.

        KV written by the failed pass cannot be trusted, so requests' own slots are freed
        uncached (`RequestKVManager.discard`); prefixes already in the cache stay valid.
        """
        if self.decode.speculator is not None:
            self.decode.speculator.forget(set())
        for req in self.table:
            self.table.remove(req)
            req.finish_reason = abort_reason(message, AbortKind.INTERNAL)
            self.stats.aborted_requests += 1
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
        holders: list[Any] = list(self.table)
        if self.disagg is not None:
            holders += self.disagg.holders()
        if self.decode.speculator is not None:
            self.decode.speculator.check_invariants()
        return self.kv.check_invariants(holders)

    def cache_tree(self, depth: int, max_nodes: int, text_tokens: int) -> dict[str, Any]:
        """A bounded snapshot of the radix tree with the latest admission (`scheduler_report`)."""
        return cache_tree(self, depth, max_nodes, text_tokens)

    def info(self) -> dict[str, Any]:
        """Live statistics for get_server_info (`scheduler_report`)."""
        return scheduler_info(self)
