"""What the HTTP server holds while it runs: the runtime pieces, model names and a shutdown flag.

The server builds the same pieces as `sglite.Engine` (scheduler process, tokenizer,
TokenizerManager) but runs the TokenizerManager on uvicorn's event loop instead of a private one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglite.http.errors import APIError
from sglite.runtime.data_parallel import DataParallelClient, create_client
from sglite.runtime.scheduler_client import SchedulerClient
from sglite.runtime.server.metrics import ServerMetrics
from sglite.runtime.server.response_store import ResponseStore
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizer import Tokenizer
from sglite.runtime.tokenizer_manager import TokenizerManager

logger = logging.getLogger("sglite.runtime.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ServerState:
    """The runtime behind one HTTP server."""

    args: ServerArgs
    tokenizer: Tokenizer
    client: SchedulerClient | DataParallelClient
    tokenizer_manager: TokenizerManager
    model_name: str  # the id clients send as `model` and see in /v1/models
    model_aliases: frozenset[str]  # other `model` values accepted for this model
    metrics: ServerMetrics
    responses: ResponseStore  # the Responses API's stored responses
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    stopped: bool = False
    restarting: bool = False  # a new scheduler is starting after the old one died
    scheduler_restarts: int = 0
    exit_code: int = 0  # non-zero once the server stops because its scheduler died
    _stop_server: Callable[[], None] | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def model_path(self) -> str:
        """The resolved path of the served model."""
        return self.client.info["model_path"]

    @property
    def hidden_size(self) -> int:
        """Width of the model's hidden states (its embeddings' size)."""
        return int(self.client.info["hidden_size"])

    @property
    def context_length(self) -> int:
        """Longest prompt + output the model accepts."""
        return self.client.info["context_length"]

    @property
    def supports_constraints(self) -> bool:
        """Whether the scheduler can constrain decoding (regex, JSON schema, EBNF).

        The scheduler announces a `grammar_backend` in its ready info once it has one.
        """
        return bool(self.client.info.get("grammar_backend"))

    def check_model(self, model: str | None) -> None:
        """Accept any `model` (clients send the name they were configured with: a tokenizer
        path, `default`, a hub id; the one model serves them all), except with
        `--strict-model-name`: then a name other than the served model's is OpenAI's 404."""
        if not self.args.strict_model_name or model is None:
            return
        if model == self.model_name or model in self.model_aliases:
            return
        raise APIError(
            404,
            f"model: the model {model!r} does not exist; this server serves {self.model_name!r}",
            param="model",
            code="model_not_found",
        )

    def check_alive(self) -> None:
        """Raise a 503 when the server cannot take requests (scheduler gone, shutting down)."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if self.restarting:
            raise APIError(
                503,
                "the model is restarting after a scheduler failure; retry shortly",
                headers={"Retry-After": "5"},
            )
        if not self.client.healthy:
            reason = self.client.death_reason or "the scheduler process is not running"
            raise APIError(503, f"the model is unavailable: {reason}")

    # ------------------------------------------------------------------ scheduler failures
    def watch_scheduler(self, stop_server: Callable[[], None]) -> None:
        """Handle a scheduler death on the running loop: restart it (`--restart-on-failure`)
        or stop the server with exit code 1. `stop_server` makes the HTTP server exit."""
        loop = asyncio.get_running_loop()
        self._stop_server = stop_server
        self.client.on_death = lambda reason: loop.call_soon_threadsafe(
            self._on_scheduler_death, reason
        )

    def _on_scheduler_death(self, reason: str) -> None:
        if self.shutting_down or self.stopped:
            return
        logger.error("the scheduler died: %s", reason)
        if self.args.restart_on_failure and not self.restarting:
            self.restarting = True
            task = asyncio.get_running_loop().create_task(self._restart_scheduler())
            self._tasks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)
            return
        self._exit_with_failure()

    def _exit_with_failure(self) -> None:
        self.exit_code = 1
        self.shutting_down = True
        if self._stop_server is not None:
            self._stop_server()

    async def _restart_scheduler(self) -> None:
        old = self.client
        try:
            await asyncio.to_thread(old.shutdown, 1.0)  # reap the dead process, close sockets
            client = await asyncio.to_thread(create_client, self.args)
        except Exception:
            logger.exception("restarting the scheduler failed; stopping the server")
            self.restarting = False
            self._exit_with_failure()
            return
        if self.shutting_down:  # stopped while the new scheduler loaded
            await asyncio.to_thread(client.shutdown)
            return
        self.client = client
        self.tokenizer_manager.client = client
        self.watch_scheduler(self._stop_server or (lambda: None))
        await self.warmup()  # /health turns 200 only once the new scheduler serves at speed
        self.scheduler_restarts += 1
        self.restarting = False
        logger.warning("the scheduler was restarted (restart %d)", self.scheduler_restarts)

    def admit(self, num_requests: int) -> None:
        """Raise a 503 with Retry-After when `num_requests` more would exceed the queue bound."""
        self.check_alive()
        in_flight = self.tokenizer_manager.num_in_flight
        if in_flight + num_requests > self.args.max_queued_requests:
            raise APIError(
                503,
                f"the server is overloaded: {in_flight} requests in flight, at most "
                f"{self.args.max_queued_requests} (--max-queued-requests); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )

    async def warmup(self) -> None:
        """Run one short generation so the first client does not pay for kernel set-up."""
        tm = self.tokenizer_manager
        reqs, _ = tm.normalize("Hello", {"max_new_tokens": 2, "temperature": 0}, rid="warmup")
        try:
            await asyncio.wait_for(tm.generate(reqs), timeout=120)
        except Exception as exc:  # a failed warm-up is not fatal; real requests will tell
            logger.warning("warm-up request failed: %s", exc)

    async def control(self, kind: str, **kwargs: Any) -> Any:
        """Run a scheduler control request without blocking the event loop."""
        return await asyncio.to_thread(self.client.control, kind, **kwargs)

    def public_args(self) -> dict[str, Any]:
        """Server arguments without secrets."""
        args = dataclasses.asdict(self.args)
        args.pop("api_key", None)
        return args

    async def drain(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for requests in flight to finish, then abort the rest."""
        tm = self.tokenizer_manager
        deadline = time.monotonic() + timeout
        while tm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if tm.num_in_flight:
            logger.warning("aborting %d requests still running at shutdown", tm.num_in_flight)
            tm.abort_all("the server is shutting down")

    def shutdown(self) -> None:
        """Stop the scheduler process (requests in flight end with an abort). Idempotent."""
        self.shutting_down = True
        if not self.stopped:
            self.stopped = True
            self.client.shutdown()


def model_names(args: ServerArgs, resolved_path: str) -> tuple[str, frozenset[str]]:
    """The served model id and the other names clients may use for it.

    The id is `--served-model-name`, else the `--model-path` as given, else the default model's
    name. The resolved path, its basename and the basename without `.gguf` are accepted too.
    """
    if args.served_model_name:
        name = args.served_model_name
    elif args.model_path:
        name = args.model_path
    else:
        name = DEFAULT_MODEL_NAME
    base = os.path.basename(resolved_path.rstrip("/"))
    aliases = {resolved_path, base, base.removesuffix(".gguf"), base.split(".")[0], "default"}
    if args.model_path:
        aliases.add(args.model_path)
    if not args.model_path:
        aliases.add(DEFAULT_MODEL_NAME)
    aliases.discard(name)
    return name, frozenset(a for a in aliases if a)


def _load_tokenizer_early(source: str | None) -> Tokenizer:
    """The tokenizer from its files (a GGUF's converted here on a first start, without torch,
    while the scheduler's process imports torch), and, when they hold a chat template, its
    transformers renderer started on a thread: this process waits for the scheduler's start-up
    anyway, while loading the renderer after it (a second of imports) would slow the warm-up."""
    from sglite.runtime.model.tokenizer_files import load_tokenizer_files

    tokenizer = load_tokenizer_files(source)
    if tokenizer is not None and tokenizer.chat_template is not None:
        tokenizer.load_hf_in_background()
    return tokenizer


def build_state(
    args: ServerArgs, client: SchedulerClient | DataParallelClient | None = None
) -> ServerState:
    """Load the tokenizer while the scheduler process loads the model; blocks until ready.

    `client`: the scheduler, already started (`create_client(args, wait=False)`), or None to
    start it here. On failure it is stopped.
    """
    if client is None:
        client = create_client(args, wait=False)
    # The tokenizer loads from its files alone (this process imports no torch); the scheduler,
    # which knows the model's family, sends its stop tokens and template.
    source = args.tokenizer_path or args.model_path
    try:
        with ThreadPoolExecutor(1) as pool:
            tokenizer_future = pool.submit(_load_tokenizer_early, source)
            client.wait_ready()
            tokenizer = tokenizer_future.result()
    except BaseException:
        client.shutdown()
        raise
    tokenizer.eos_token_ids = list(client.served_tokens["eos_token_ids"])
    tokenizer.chat_template = client.served_tokens["chat_template"]
    if tokenizer.chat_template is not None:  # chat templates render with transformers
        tokenizer.load_hf_in_background()
    tm = TokenizerManager(args, tokenizer, client)
    name, aliases = model_names(args, client.info["model_path"])

    def live_info() -> dict[str, Any]:
        current = state.client  # a restart replaces the client
        return current.control("get_info", timeout=10.0) if current.healthy else {}

    metrics = ServerMetrics(live_info, lambda: tm.num_in_flight, name)
    tm.output_hooks.append(metrics.on_output)
    responses = ResponseStore(args.max_stored_responses)
    state = ServerState(args, tokenizer, client, tm, name, aliases, metrics, responses)
    return state
