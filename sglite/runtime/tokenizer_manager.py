"""Request front end shared by the Engine and the HTTP server.

Tokenizes and validates requests, expands batches and `n > 1`, sends them to the scheduler and
turns its increments into SGLang-shaped results: `{"text", "output_ids", "meta_info"}`.
All methods are coroutines on one asyncio loop; results from the scheduler's receiver thread
enter the loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglite.runtime.constrained import CONSTRAINT_KINDS, validate_constraint
from sglite.runtime.disaggregation.messages import Bootstrap
from sglite.runtime.multimodal.image_input import ImageLimits
from sglite.runtime.multimodal.processor import (
    ImageItem,
    ImagePromptBuilder,
    PreparedImage,
    is_pad,
)
from sglite.runtime.multimodal.spec import vision_spec
from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.scheduler.io import GenerateInput, RequestOutput, check_segments
from sglite.runtime.scheduler_client import SchedulerClient
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sglite.runtime.data_parallel import DataParallelClient

# Called on the event loop for every scheduler increment: (increment, seconds since the request was
# submitted, seconds since its previous token-bearing increment or None for the first one). The
# HTTP server derives its time-to-first-token and inter-token latency metrics from it.
OutputHook = Callable[[RequestOutput, float, "float | None"], None]


@dataclass
class GenerateRequest:
    """One prompt's generation as the user asked for it (before `n` expansion)."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    pooling: str | None = None  # an embedding request ("last" or "mean")
    images: list[ImageItem] = field(default_factory=list)  # in the prompt (expanded ids)
    bootstrap: Bootstrap | None = None  # disaggregated serving: prefill server and room
    segments: list[tuple[int, int]] = field(default_factory=list)  # reusable token spans


@dataclass
class _RequestState:
    """Accumulated result of one scheduler request."""

    req: GenerateRequest
    queue: asyncio.Queue
    start: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    input_logprobs: list[list[Any]] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    output_logprobs: list[list[Any]] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)
    finished: bool = False
    last_token_time: float | None = None
    embedding: list[float] | None = None


class TokenizerManager:
    """Validates, tokenizes and tracks requests; one instance per engine or server."""

    def __init__(
        self, args: ServerArgs, tokenizer: Tokenizer, client: SchedulerClient | DataParallelClient
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.client = client
        self.context_len: int = client.info["context_length"]
        self.max_total_tokens: int = client.info["max_total_num_tokens"]
        self.vocab_size: int = client.info["vocab_size"]
        self._loop: asyncio.AbstractEventLoop | None = None
        # Requests submitted to the scheduler whose consumer has not finished with them yet.
        self.in_flight: dict[str, _RequestState] = {}
        self.output_hooks: list[OutputHook] = []
        spec = vision_spec(client.info.get("model_path"))
        self.images: ImagePromptBuilder | None = None
        if spec is not None:
            limits = ImageLimits(
                max_images=args.max_images_per_request, allow_remote=args.allow_remote_images
            )
            self.images = ImagePromptBuilder(spec, tokenizer.hf, limits)
        self._image_worker = ThreadPoolExecutor(1, thread_name_prefix="images")

    @property
    def num_in_flight(self) -> int:
        """Scheduler requests (after `n` expansion) currently being served."""
        return len(self.in_flight)

    def abort_all(self, message: str) -> None:
        """Abort every request in flight (server shutdown); each ends with an abort reason."""
        for rid in list(self.in_flight):
            self.client.abort(rid, message)

    # ------------------------------------------------------------------ normalisation
    def normalize(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        image_data: Any = None,
        image_items: list[ImageItem] | None = None,
        segments: list | None = None,
    ) -> tuple[list[GenerateRequest], bool]:
        """Turn user arguments into validated requests. Returns (requests, is_batch).

        Raises ValueError naming the problem (empty prompt, bad sampling parameter, a prompt too
        long for the context or the KV pool, token ids outside the vocabulary, a bad image or
        images for a text-only model). `image_data`: per prompt an image or a list of them
        (a list per prompt for a batch). `segments`: reusable spans `[start, end)` of the prompt
        (character spans of a text prompt, token spans of `input_ids`; a list per prompt for a
        batch), see scheduler/segments.py.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            texts = prompt if is_batch else [prompt]
            if is_batch and not texts:
                raise ValueError("the prompt list is empty")
            for text in texts:
                if not isinstance(text, str):
                    raise ValueError(f"text must be a string or a list of strings, got {text!r}")
            ids_list = [self.tokenizer.encode(t) for t in texts]
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids_list = input_ids if is_batch else [input_ids]
        n = len(ids_list)
        spans_per_prompt = _per_prompt(segments, n, is_batch)
        if prompt is not None and segments is not None:
            pairs = [self.encode_with_segments(t, sp) for t, sp in zip(texts, spans_per_prompt)]
            ids_list, spans_per_prompt = [p[0] for p in pairs], [p[1] for p in pairs]
        images_per_prompt = self._split_images(image_data, n, is_batch)
        reqs = []
        for i, ids in enumerate(ids_list):
            params = _pick(sampling_params, i, n) or {}
            if not isinstance(params, dict):
                raise ValueError("sampling_params must be an object")
            images: list[ImageItem] = list(image_items or [])
            if images_per_prompt[i]:
                where = f"image_data[{i}]" if is_batch else "image_data"
                ids, images = self.expand_images(ids, images_per_prompt[i], where)
            if spans_per_prompt[i]:
                problem = check_segments(spans_per_prompt[i], len(ids))
                if problem:
                    raise ValueError(problem)
            reqs.append(
                self._make_request(
                    ids,
                    params,
                    rid=_pick(rid, i, n) or uuid.uuid4().hex,
                    return_logprob=bool(_pick(return_logprob, i, n)),
                    logprob_start_len=_pick(logprob_start_len, i, n),
                    top_logprobs_num=_pick(top_logprobs_num, i, n),
                    return_text_in_logprobs=return_text_in_logprobs,
                    images=images,
                )
            )
            reqs[-1].segments = [tuple(span) for span in spans_per_prompt[i]]
        return reqs, is_batch

    def encode_with_segments(
        self, text: str, spans: list[Any]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """A text prompt tokenized piece by piece at its segments' character boundaries (so a
        segment's tokens are the same wherever it appears), and the segments' token spans."""
        problem = check_segments(spans, len(text))
        if problem:
            raise ValueError(problem.replace("token", "character"))
        ids: list[int] = []
        token_spans = []
        cut = 0
        for start, end in spans:
            ids += self._encode_piece(text[cut:start], first=not ids and cut == 0)
            piece = self._encode_piece(text[start:end], first=not ids)
            token_spans.append((len(ids), len(ids) + len(piece)))
            ids += piece
            cut = end
        ids += self._encode_piece(text[cut:], first=not ids)
        return ids, token_spans

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        if first:
            return self.tokenizer.encode(text)  # with the model's BOS
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def expand_images(
        self, ids: list[int], images: list[Any], where: str
    ) -> tuple[list[int], list[ImageItem]]:
        """A prompt's ids with its images' spans, and the images (`ImagePromptBuilder.build`);
        ValueError naming `where` for bad images or a text-only model."""
        if self.images is None:
            raise ValueError(f"{where}: this model takes text only (it has no vision tower)")
        return self.images.build(ids, images, where)

    async def prepare_images(self, image_data: Any, where: str) -> Any:
        """`image_data` (one image, a list, or a list of lists) with each image read and
        preprocessed, off the event loop (one worker: a big image must not stall the streams
        being served). ValueError naming the image's place for a bad one."""
        if image_data is None or self.images is None:
            return image_data
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._image_worker, self._prepare_tree, image_data, where)

    def _prepare_tree(self, data: Any, where: str) -> Any:
        assert self.images is not None
        if isinstance(data, list):
            return [self._prepare_tree(d, f"{where}[{i}]") for i, d in enumerate(data)]
        if data is None or isinstance(data, PreparedImage):
            return data
        label = data.get("label") if isinstance(data, dict) else None
        return self.images.prepare(data, label or where)

    def _split_images(self, image_data: Any, n: int, is_batch: bool) -> list[list[Any]]:
        """Each prompt's list of images (empty lists without `image_data`)."""
        if image_data is None:
            return [[] for _ in range(n)]
        if self.images is None:
            raise ValueError("image_data: this model takes text only (it has no vision tower)")
        if not is_batch:
            return [image_data if isinstance(image_data, list) else [image_data]]
        if not isinstance(image_data, list) or len(image_data) != n:
            raise ValueError(f"image_data: a batch of {n} prompts needs a list of {n} entries")
        return [[] if d is None else d if isinstance(d, list) else [d] for d in image_data]

    def _make_request(
        self,
        ids: Any,
        params: dict[str, Any],
        rid: str,
        return_logprob: bool,
        logprob_start_len: Any,
        top_logprobs_num: Any,
        return_text_in_logprobs: bool,
        images: list[ImageItem],
    ) -> GenerateRequest:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("input_ids must be a list of integers (or a list of such lists)")
        if not ids:
            raise ValueError("the prompt is empty: it has no tokens")
        pads = {i.offset + p for i in images for p in i.feature_positions} if images else ()
        bad = [
            t for k, t in enumerate(ids) if t >= self.vocab_size or (is_pad(t) and k not in pads)
        ]
        if bad:
            raise ValueError(
                f"input_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})"
            )
        parsed = SamplingParams.from_dict(params)
        if parsed.n > self.args.max_n:
            raise ValueError(f"n must be <= {self.args.max_n} (--max-n), got {parsed.n}")
        limit = self.args.max_new_tokens_limit
        if limit is not None and parsed.max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens must be <= {limit} (--max-new-tokens-limit), "
                f"got {parsed.max_new_tokens}"
            )
        if parsed.constraint is not None:
            # Refuse a grammar that does not compile here (400), before it is queued.
            validate_constraint(*parsed.constraint, backend=self.args.grammar_backend)
        if len(ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        if len(ids) + parsed.max_new_tokens > self.context_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({parsed.max_new_tokens}) exceeds "
                f"the context length ({self.context_len})"
            )
        if len(ids) + parsed.max_new_tokens > self.max_total_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({parsed.max_new_tokens}) exceeds "
                f"the KV cache pool ({self.max_total_tokens} tokens)"
            )
        start = -1 if logprob_start_len is None else logprob_start_len
        if not isinstance(start, int) or start < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start!r}")
        top = 0 if top_logprobs_num is None else top_logprobs_num
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise ValueError(f"top_logprobs_num must be an integer in [0, 20], got {top!r}")
        return GenerateRequest(
            input_ids=ids,
            sampling_params=parsed.to_dict(),
            rid=str(rid),
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top,
            return_text_in_logprobs=return_text_in_logprobs,
            images=images,
        )

    def embedding_requests(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
    ) -> tuple[list[GenerateRequest], bool]:
        """Requests for the pooled hidden states of each prompt (`--pooling`), validated as
        `normalize` validates prompts (a prompt longer than the context is a ValueError).
        Returns (requests, is_batch)."""
        reqs, is_batch = self.normalize(
            prompt=prompt, input_ids=input_ids, sampling_params={"max_new_tokens": 0}, rid=rid
        )
        for req in reqs:
            req.pooling = self.args.pooling
        return reqs, is_batch

    @staticmethod
    def expand_n(reqs: list[GenerateRequest]) -> list[GenerateRequest]:
        """Replace each request with n > 1 by n requests (prompt-major order, distinct seeds)."""
        out: list[GenerateRequest] = []
        for req in reqs:
            n = req.sampling_params.get("n", 1)
            if n == 1:
                out.append(req)
                continue
            for j in range(n):
                params = dict(req.sampling_params, n=1)
                if params.get("seed") is not None:
                    params["seed"] = params["seed"] + j
                out.append(
                    GenerateRequest(
                        req.input_ids,
                        params,
                        f"{req.rid}-{j}",
                        req.return_logprob,
                        req.logprob_start_len,
                        req.top_logprobs_num,
                        req.return_text_in_logprobs,
                        images=req.images,
                        segments=req.segments,
                    )
                )
        return out

    # ------------------------------------------------------------------ running
    def _submit(self, req: GenerateRequest, stream: bool) -> _RequestState:
        loop = asyncio.get_running_loop()
        state = _RequestState(req=req, queue=asyncio.Queue(), start=time.perf_counter())

        def on_output(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(state.queue.put_nowait, out)

        inp = GenerateInput(
            rid=req.rid,
            input_ids=req.input_ids,
            sampling_params=req.sampling_params,
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num,
            arrival_time=time.monotonic(),
            stream=stream,
            pooling=req.pooling,
            images=req.images,
            bootstrap=req.bootstrap,
            segments=list(req.segments),
        )
        self.client.submit(inp, on_output)
        self.in_flight[req.rid] = state
        return state

    def _done(self, state: _RequestState) -> None:
        # The consumer is finished with the request; abort it if the scheduler still runs it.
        self.in_flight.pop(state.req.rid, None)
        if not state.finished:
            self.client.abort(state.req.rid, "the client went away")

    async def _next_output(self, state: _RequestState) -> RequestOutput:
        """The request's next increment; past `--request-timeout` the request is aborted and
        this returns the abort at once (the scheduler's own answer may come later or never)."""
        timeout = self.args.request_timeout
        if timeout is None:
            return await state.queue.get()
        remaining = state.start + timeout - time.perf_counter()
        try:
            return await asyncio.wait_for(state.queue.get(), max(0.0, remaining))
        except asyncio.TimeoutError:
            message = f"the request timed out after {timeout:g} s (--request-timeout)"
            self.client.abort(state.req.rid, message)
            reason = {"type": "abort", "message": message}
            return RequestOutput(state.req.rid, [], "", finish_reason=reason)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Yield one result per scheduler increment (cumulative text, new logprobs only).

        If the consumer stops early (client disconnect, cancellation), the request is aborted so
        its KV slots are freed.
        """
        state = self._submit(req, stream=True)
        try:
            while True:
                out = await self._next_output(state)
                chunk = self._apply(state, out, incremental=True)
                yield chunk
                if state.finished:
                    return
        finally:
            self._done(state)

    async def generate_one(self, req: GenerateRequest) -> dict[str, Any]:
        """Run one request to completion and return its whole result."""
        state = self._submit(req, stream=False)
        try:
            while not state.finished:
                out = await self._next_output(state)
                self._apply(state, out, incremental=False)
        finally:
            self._done(state)
        return self._result(state, incremental=False)

    async def generate(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        """Run several requests concurrently; results in the same order."""
        return list(await asyncio.gather(*(self.generate_one(r) for r in reqs)))

    # ------------------------------------------------------------------ shaping results
    def _apply(self, state: _RequestState, out: RequestOutput, incremental: bool) -> dict:
        if self.output_hooks:
            self._run_hooks(state, out)
        state.text += out.new_text
        state.output_ids.extend(out.new_token_ids)
        state.meta.update(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            cached_tokens_details=out.cached_tokens_details,
            finish_reason=out.finish_reason,
            jump_forward_drafted_tokens=out.jump_forward_drafted,
            jump_forward_accepted_tokens=out.jump_forward_accepted,
            spec_draft_tokens=out.spec_drafted,
            spec_accepted_tokens=out.spec_accepted,
            spec_verify_ct=out.spec_verify_ct,
            segment_tokens=out.segment_tokens,
        )
        req = state.req
        new_in, new_out, new_in_top, new_out_top = [], [], [], []
        if req.return_logprob:
            new_in = [self._lp(v, t, req) for v, t in out.input_token_logprobs or []]
            new_out = [self._lp(v, t, req) for v, t in out.output_token_logprobs or []]
            if req.top_logprobs_num:
                new_in_top = [self._top(x, req) for x in out.input_top_logprobs or []]
                new_out_top = [self._top(x, req) for x in out.output_top_logprobs or []]
            state.input_logprobs += new_in
            state.output_logprobs += new_out
            state.input_top += new_in_top
            state.output_top += new_out_top
        if out.embedding is not None:
            state.embedding = out.embedding
        if out.finish_reason is not None:
            state.finished = True
        if not incremental:
            return {}
        result = self._result(state, incremental=True)
        if req.return_logprob:
            # Only the new tokens' entries, and how many the stream has carried in all (as
            # SGLang 0.5 streams them, so a client can check it got every token).
            result["meta_info"]["output_token_logprobs"] = new_out
            result["meta_info"]["output_token_logprobs_length"] = len(state.output_logprobs)
            if req.top_logprobs_num:
                result["meta_info"]["output_top_logprobs"] = new_out_top
        return result

    def _run_hooks(self, state: _RequestState, out: RequestOutput) -> None:
        now = time.perf_counter()
        gap = None if state.last_token_time is None else now - state.last_token_time
        if out.new_token_ids:
            state.last_token_time = now
        for hook in self.output_hooks:
            hook(out, now - state.start, gap)

    def _result(self, state: _RequestState, incremental: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": state.req.rid,
            "finish_reason": state.meta.get("finish_reason"),
            "prompt_tokens": state.meta.get("prompt_tokens", len(state.req.input_ids)),
            "completion_tokens": state.meta.get("completion_tokens", 0),
            "cached_tokens": state.meta.get("cached_tokens", 0),
            # Where the cached tokens came from: {"device", "host", "disk"}, summing to the total.
            "cached_tokens_details": state.meta.get("cached_tokens_details")
            or {"device": state.meta.get("cached_tokens", 0), "host": 0, "disk": 0},
            "e2e_latency": time.perf_counter() - state.start,
            # SGLang names the weights a result came from (they change with update_weights).
            "weight_version": "default",
        }
        if any(state.req.sampling_params.get(k) is not None for k in CONSTRAINT_KINDS):
            meta["jump_forward_drafted_tokens"] = state.meta.get("jump_forward_drafted_tokens", 0)
            meta["jump_forward_accepted_tokens"] = state.meta.get("jump_forward_accepted_tokens", 0)
        if self.args.speculative_algorithm is not None:
            for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_ct"):
                meta[key] = state.meta.get(key, 0)
        if state.req.segments:
            meta["segment_tokens"] = state.meta.get("segment_tokens")
        if state.req.return_logprob:
            meta["input_token_logprobs"] = state.input_logprobs
            meta["output_token_logprobs"] = state.output_logprobs
            if state.req.top_logprobs_num:
                meta["input_top_logprobs"] = state.input_top
                meta["output_top_logprobs"] = state.output_top
        result = {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
        if state.req.pooling is not None:
            result = {"embedding": state.embedding, "meta_info": meta}
        return result

    def _token_text(self, token_id: int, req: GenerateRequest) -> str | None:
        if not req.return_text_in_logprobs:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _lp(self, value: float | None, token_id: int, req: GenerateRequest) -> list[Any]:
        return [value, token_id, self._token_text(token_id, req)]

    def _top(self, entries: Any, req: GenerateRequest) -> Any:
        if entries is None:
            return None
        return [self._lp(v, t, req) for v, t in entries]


def _per_prompt(segments: list | None, n: int, is_batch: bool) -> list[list[Any]]:
    """Each prompt's segment spans: a list of spans for one prompt, a list of n for a batch."""
    if segments is None:
        return [[] for _ in range(n)]
    if not isinstance(segments, list):
        raise ValueError("segments must be a list of [start, end] spans")
    if not is_batch:
        return [segments]
    if len(segments) != n or not all(isinstance(s, list) for s in segments):
        raise ValueError(f"segments: a batch of {n} prompts needs a list of {n} span lists")
    return segments


def _pick(value: Any, i: int, n: int) -> Any:
    """Per-item value of an argument given either once for all items or as a list of n."""
    if isinstance(value, list) and len(value) == n:
        return value[i]
    return value
