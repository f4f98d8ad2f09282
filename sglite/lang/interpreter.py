"""Running programs: one call (`run_program`), a batch in a thread pool (`run_program_batch`), the
constant prefix sent to the cache (`cache_program`).

The function body runs on the calling thread and appends to a `ProgramState`
(`program_state.py`), whose `StreamExecutor` (`stream_executor.py`) runs the expressions in order
on its own thread.
"""

from __future__ import annotations

import contextvars
import logging
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sglite.lang.global_config import global_config
from sglite.lang.program_state import ProgramState
from sglite.lang.sampling_params import SglSamplingParams
from sglite.lang.stream_executor import StreamExecutor

logger = logging.getLogger(__name__)


class Program(Protocol):
    """What running needs of a program (`program.SglFunction`, which calls the functions below):
    the body, the arguments `bind` fixed, the argument names (for tracing) and the API
    speculation budget."""

    func: Callable[..., Any]
    bind_arguments: dict[str, Any]
    arg_names: list[str]
    num_api_spec_tokens: int | None


def resolve_backend(backend: Any) -> Any:
    """The backend to run on: `backend`, else the default one; an `sglite.Engine` is wrapped in
    its `EngineBackend`, a `Runtime` becomes its endpoint. Raises ValueError when there is none."""
    from sglite.lang.backend.engine_backend import as_backend

    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ValueError(
            "no backend: call sgl.set_default_backend(sgl.RuntimeEndpoint(url) or sgl.Engine()) "
            "or pass backend= to run()"
        )
    return as_backend(backend)


def _run_body(
    state: ProgramState,
    program: Program,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    sync: bool,
    capture_errors: bool,
) -> None:
    executor = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except Exception as exc:
        executor.record_error(exc)
        if not capture_errors:
            raise
    finally:
        executor.end()
    if sync:
        executor.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program(
    program: Program,
    backend: Any,
    func_args: tuple[Any, ...],
    func_kwargs: dict[str, Any],
    default_sampling_para: SglSamplingParams,
    stream: bool,
    sync: bool = False,
    capture_errors: bool = False,
) -> ProgramState:
    """Run `program` once and return its state.

    The function body runs on the calling thread (on a new thread when `stream`); generations
    run on the state's worker thread. With `sync` it returns only when every expression has run.
    An exception raised by the function body itself propagates unless `capture_errors` (then it
    is the state's `error()`); with `stream` it is always captured.
    """
    backend = resolve_backend(backend)
    kwargs = {**func_kwargs, **program.bind_arguments}
    executor = StreamExecutor(
        backend,
        kwargs,
        default_sampling_para,
        chat_template=None,
        stream=stream,
        num_api_spec_tokens=program.num_api_spec_tokens,
    )
    state = ProgramState(executor)
    if stream:
        body = threading.Thread(
            target=contextvars.copy_context().run,
            args=(_run_body, state, program, func_args, kwargs, sync, True),
            daemon=True,
            name="sgl-program-body",
        )
        body.start()
    else:
        _run_body(state, program, func_args, kwargs, sync, capture_errors)
    return state


def cache_program(program: Program, backend: Any) -> str:
    """Send the program's constant prefix (by tracing) to the backend's cache.

    Only prefixes longer than `global_config.precache_min_chars` are sent; failures are logged,
    never raised, since pre-caching is an optimisation. Returns the prefix found.
    """
    from sglite.lang.tracer import extract_prefix_by_tracing

    backend = resolve_backend(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if prefix and len(prefix) > global_config.precache_min_chars:
        try:
            backend.cache_prefix(prefix)
        except Exception as exc:
            logger.warning("pre-caching the program prefix failed: %s", exc)
    return prefix


def run_program_batch(
    program: Program,
    backend: Any,
    batch_arguments: list[dict[str, Any]],
    default_sampling_para: SglSamplingParams,
    num_threads: int | str,
    progress_bar: bool,
    generator_style: bool = False,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Run `program` once per argument dict in a thread pool; results keep the input order.

    A failing program does not stop the others: its state's `error()` holds the exception.
    """
    backend = resolve_backend(backend)
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        cache_program(program, backend)
    if num_threads == "auto":
        num_threads = max(96, multiprocessing.cpu_count() * 16)
    num_threads = max(1, min(int(num_threads), len(batch_arguments)))

    def one(arguments: dict[str, Any]) -> ProgramState:
        return run_program(
            program, backend, (), arguments, default_sampling_para, False, True, True
        )

    if generator_style:
        return _batch_generator(one, batch_arguments, num_threads, progress_bar)
    return list(_batch_generator(one, batch_arguments, num_threads, progress_bar))


def _batch_generator(
    one: Callable[[dict[str, Any]], ProgramState],
    batch_arguments: list[dict[str, Any]],
    num_threads: int,
    progress_bar: bool,
) -> Iterator[ProgramState]:
    import tqdm

    bar = tqdm.tqdm(total=len(batch_arguments)) if progress_bar else None
    try:
        if num_threads == 1:
            for arguments in batch_arguments:
                yield one(arguments)
                if bar is not None:
                    bar.update()
            return
        # Submit in chunks so a generator consumer sees results before the whole batch is queued.
        chunk = max(200, num_threads)
        with ThreadPoolExecutor(num_threads, thread_name_prefix="sgl-batch") as pool:
            for begin in range(0, len(batch_arguments), chunk):
                futures = [pool.submit(one, a) for a in batch_arguments[begin : begin + chunk]]
                if bar is not None:
                    for f in futures:
                        f.add_done_callback(lambda _: bar.update())
                for f in futures:
                    yield f.result()
    finally:
        if bar is not None:
            bar.close()
