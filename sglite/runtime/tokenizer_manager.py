"""Request front end shared by the Engine and the HTTP server: the coordinator of a request's life.

validate and tokenize (`normalize`) -> send (`_submit`) -> accumulate the scheduler's increments
-> result, SGLang-shaped: `{"text", "output_ids", "meta_info"}`. The jobs along the way are in
`sglite/runtime/tokenizing/`: prompt building (text, ids, images, segment spans into token ids),
validation, batch and `n` expansion, result accumulation and shaping, embeddings.
All methods are coroutines or plain calls on one asyncio loop; results from the scheduler's
receiver thread enter the loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglite.runtime.multimodal.image_input import ImageLimits
from sglite.runtime.multimodal.processor import ImageItem, ImagePromptBuilder
from sglite.runtime.multimodal.spec import vision_spec
from sglite.runtime.scheduler.io import AbortKind, GenerateInput, RequestOutput, abort_reason
from sglite.runtime.scheduler_client import SchedulerClient
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizer import Tokenizer
from sglite.runtime.tokenizing import embeddings, expansion
from sglite.runtime.tokenizing.prompts import PromptBuilder
from sglite.runtime.tokenizing.request import GenerateRequest
from sglite.runtime.tokenizing.results import NewLogprobs, RequestResult, ResultBuilder
from sglite.runtime.tokenizing.validation import RequestLimits

if TYPE_CHECKING:
    from sglite.runtime.data_parallel import DataParallelClient

__all__ = ["GenerateRequest", "OutputHook", "TokenizerManager"]

# Called on the event loop for every scheduler increment: (increment, seconds since the request was
# submitted, seconds since its previous token-bearing increment or None for the first one). The
# HTTP server derives its time-to-first-token and inter-token latency metrics from it.
OutputHook = Callable[[RequestOutput, float, "float | None"], None]


@dataclass
class _RequestState:
    """One submitted scheduler request: its increments' queue and its result so far."""

    result: RequestResult
    queue: asyncio.Queue
    last_token_time: float | None = None  # of its latest token-bearing increment (hooks)

    @property
    def req(self) -> GenerateRequest:
        return self.result.req

    @property
    def finished(self) -> bool:
        return self.result.finished


class TokenizerManager:
    """Validates, tokenizes and tracks requests; one instance per engine or server."""

    def __init__(
        self, args: ServerArgs, tokenizer: Tokenizer, client: SchedulerClient | DataParallelClient
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.client = client
        self.limits = RequestLimits.of(args, client.info)
        self.context_len: int = self.limits.context_len
        self.max_total_tokens: int = self.limits.max_total_tokens
        self.vocab_size: int = self.limits.vocab_size
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
        self.prompts = PromptBuilder(tokenizer, self.images)
        self.results = ResultBuilder(tokenizer, args.speculative_algorithm is not None)

    @property
    def num_in_flight(self) -> int:
        """Scheduler requests (after `n` expansion) currently being served."""
        return len(self.in_flight)

    def abort_all(self, message: str) -> None:
        """Abort every request in flight (server shutdown); each ends with an abort reason."""
        for rid in list(self.in_flight):
            self.client.abort(rid, message, AbortKind.UNAVAILABLE)

    # ------------------------------------------------------------------ validate and tokenize
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
        texts, ids_list, is_batch = self.prompts.token_ids(prompt, input_ids)
        n = len(ids_list)
        spans_per_prompt = expansion.per_prompt_segments(segments, n, is_batch)
        if texts is not None and segments is not None:
            pairs = [
                self.prompts.encode_with_segments(t, sp) for t, sp in zip(texts, spans_per_prompt)
            ]
            ids_list, spans_per_prompt = [p[0] for p in pairs], [p[1] for p in pairs]
        if image_data is not None:
            self.prompts.require_vision("image_data")
        images_per_prompt = expansion.per_prompt_images(image_data, n, is_batch)
        reqs = []
        for i, ids in enumerate(ids_list):
            params = expansion.pick(sampling_params, i, n) or {}
            if not isinstance(params, dict):
                raise ValueError("sampling_params must be an object")
            images: list[ImageItem] = list(image_items or [])
            if images_per_prompt[i]:
                where = f"image_data[{i}]" if is_batch else "image_data"
                ids, images = self.prompts.expand_images(ids, images_per_prompt[i], where)
            reqs.append(
                self.limits.request(
                    ids,
                    params,
                    rid=expansion.pick(rid, i, n) or uuid.uuid4().hex,
                    return_logprob=bool(expansion.pick(return_logprob, i, n)),
                    logprob_start_len=expansion.pick(logprob_start_len, i, n),
                    top_logprobs_num=expansion.pick(top_logprobs_num, i, n),
                    return_text_in_logprobs=return_text_in_logprobs,
                    images=images,
                    segments=spans_per_prompt[i],
                )
            )
        return reqs, is_batch

    def encode_with_segments(
        self, text: str, spans: list[Any]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`PromptBuilder.encode_with_segments`: a text tokenized at its segments' boundaries,
        and the segments' token spans."""
        return self.prompts.encode_with_segments(text, spans)

    def expand_images(
        self, ids: list[int], images: list[Any], where: str
    ) -> tuple[list[int], list[ImageItem]]:
        """`PromptBuilder.expand_images`: a prompt's ids with its images' spans, and the
        images."""
        return self.prompts.expand_images(ids, images, where)

    async def prepare_images(self, image_data: Any, where: str) -> Any:
        """`PromptBuilder.prepare_images`: each image read and preprocessed off the loop."""
        return await self.prompts.prepare_images(image_data, where)

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
            prompt=prompt,
            input_ids=input_ids,
            sampling_params=embeddings.embedding_sampling_params(),
            rid=rid,
        )
        embeddings.mark_pooled(reqs, self.args.pooling)
        return reqs, is_batch

    @staticmethod
    def expand_n(reqs: list[GenerateRequest]) -> list[GenerateRequest]:
        """`expansion.expand_n`: each request with n > 1 as n requests (prompt-major order)."""
        return expansion.expand_n(reqs)

    # ------------------------------------------------------------------ send and accumulate
    def _submit(self, req: GenerateRequest, stream: bool) -> _RequestState:
        loop = asyncio.get_running_loop()
        state = _RequestState(RequestResult(req, start=time.perf_counter()), asyncio.Queue())

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
        remaining = state.result.start + timeout - time.perf_counter()
        try:
            return await asyncio.wait_for(state.queue.get(), max(0.0, remaining))
        except asyncio.TimeoutError:
            message = f"the request timed out after {timeout:g} s (--request-timeout)"
            self.client.abort(state.req.rid, message, AbortKind.TIMEOUT)
            reason = abort_reason(message, AbortKind.TIMEOUT)
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
                new = self._accumulate(state, out)
                yield self.results.chunk(state.result, new)
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
                self._accumulate(state, out)
        finally:
            self._done(state)
        return self.results.whole(state.result)

    async def generate(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        """Run several requests concurrently; results in the same order."""
        return list(await asyncio.gather(*(self.generate_one(r) for r in reqs)))

    def _accumulate(self, state: _RequestState, out: RequestOutput) -> NewLogprobs:
        """Run the output hooks on `out`, then add it to the request's result."""
        if self.output_hooks:
            self._run_hooks(state, out)
        return self.results.add(state.result, out)

    def _run_hooks(self, state: _RequestState, out: RequestOutput) -> None:
        now = time.perf_counter()
        gap = None if state.last_token_time is None else now - state.last_token_time
        if out.new_token_ids:
            state.last_token_time = now
        for hook in self.output_hooks:
            hook(out, now - state.result.start, gap)
