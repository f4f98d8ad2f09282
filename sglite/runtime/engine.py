"""`sglite.Engine`: the runtime in-process, without HTTP, shaped like SGLang's `sgl.Engine`.

The model runs in a scheduler child process; this object tokenizes, sends requests and collects
results on a private asyncio loop thread, so both the blocking and the async API are available.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglite.runtime.data_parallel import create_client
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizer_manager import TokenizerManager
from sglite.runtime.tokenizing.request import GenerateRequest


class Engine:
    """An LLM engine with RadixAttention and continuous batching.

    Options are the server's flags as keywords (`chunked_prefill_size=` for
    `--chunked-prefill-size`); see `ServerArgs`. Use as a context manager or call `shutdown()`;
    the scheduler process also ends when this process exits or crashes.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(engine=True, model_path=model_path, **kwargs)
        # Import torch and load the tokenizer here while the scheduler process starts and loads
        # the model (seconds each; in sequence they added up).
        with ThreadPoolExecutor(1) as pool:
            tokenizer_future = pool.submit(
                _load_tokenizer, self.server_args.tokenizer_path, self.server_args.model_path
            )
            self.client = create_client(self.server_args)
            self.tokenizer = tokenizer_future.result()
        self.tokenizer_manager = TokenizerManager(self.server_args, self.tokenizer, self.client)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="sglite-engine-loop"
        )
        self._thread.start()
        self._closed = False
        atexit.register(_shutdown_ref, weakref.ref(self))

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        image_data: Any = None,
        segments: list | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict), a batch (a list), or stream one prompt's chunks.

        A single prompt with `n > 1` returns a list of n results. `image_data` (vision-language
        models): an image (data: URL, file path, base64 or bytes) or a list of them, a list per
        prompt for a batch; the prompt's image tokens mark where they go (else they go first).
        `segments`: spans `[start, end)` of the prompt (characters of a text prompt, tokens of
        `input_ids`; a list per prompt for a batch) whose KV is cached by content and reused
        wherever they appear (`--segment-recompute-fraction`; docs/segments.md).
        Raises ValueError for invalid input (the engine keeps serving).
        """
        reqs, single = self._prepare(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, return_text_in_logprobs, stream, rid, image_data, segments,
        )  # fmt: skip
        if stream:
            return self._stream_sync(reqs[0])
        results = self._run(self.tokenizer_manager.generate(reqs))
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        image_data: Any = None,
        segments: list | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """The coroutine form of `generate`; with `stream=True` it returns an async iterator."""
        reqs, single = self._prepare(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, return_text_in_logprobs, stream, rid, image_data, segments,
        )  # fmt: skip
        if stream:
            return self._stream_async(reqs[0])
        fut = asyncio.run_coroutine_threadsafe(self.tokenizer_manager.generate(reqs), self._loop)
        results = await asyncio.wrap_future(fut)
        return results[0] if single else results

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embed one prompt (a dict `{"embedding", "meta_info"}`) or a batch (a list): the
        model's final hidden states pooled as `pooling` says (last token or mean) and
        L2-normalized. Raises ValueError for invalid input."""
        self._check_open()
        reqs, is_batch = self.tokenizer_manager.embedding_requests(prompt, input_ids)
        results = self._run(self.tokenizer_manager.generate(reqs))
        return results if is_batch else results[0]

    def _prepare(self, *args: Any) -> tuple[list[GenerateRequest], bool]:
        self._check_open()
        stream = args[7]
        tm = self.tokenizer_manager
        reqs, is_batch = tm.normalize(*args[:7], rid=args[8], image_data=args[9], segments=args[10])
        expanded = tm.expand_n(reqs)
        if stream and (is_batch or len(expanded) != 1):
            raise ValueError("stream=True takes a single prompt with n=1")
        single = not is_batch and len(expanded) == 1
        return expanded, single

    def _stream_sync(self, req: GenerateRequest) -> Iterator[dict[str, Any]]:
        agen = self.tokenizer_manager.stream(req)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    async def _stream_async(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        agen = self.tokenizer_manager.stream(req)
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    yield await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
        finally:
            fut = asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop)
            await asyncio.wrap_future(fut)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        """Empty the radix cache. Raises RuntimeError while requests are in flight."""
        self._check_open()
        return self.client.control("flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        """Server arguments, model facts and live stats (hit rate, pool usage, queue lengths)."""
        self._check_open()
        info = dict(self.client.control("get_info"))
        info.update(self.client.info)
        info["server_args"] = {k: v for k, v in vars(self.server_args).items() if k != "api_key"}
        return info

    def check_invariants(self) -> dict[str, int]:
        """Verify the KV slot accounting in the scheduler (raises RuntimeError on a leak)."""
        self._check_open()
        return self.client.control("check_invariants")

    def shutdown(self) -> None:
        """Stop the scheduler process; requests in flight end with an abort. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.client.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _shutdown_ref(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


def _load_tokenizer(tokenizer_path: str | None, model_path: str | None) -> Any:
    from sglite.runtime.model.loader import load_tokenizer

    return load_tokenizer(tokenizer_path or model_path, model_path)
