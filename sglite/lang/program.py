"""The program object: `@sgl.function` turns a Python function into an `SglFunction`.

It ties the expressions (`ir.py`) to the two ways of executing them, running (`interpreter.py`,
`program_state.py`, `stream_executor.py`) and tracing (`tracer.py`), so the IR itself depends on
neither.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from sglite.lang.interpreter import cache_program, run_program, run_program_batch
from sglite.lang.program_state import ProgramState
from sglite.lang.sampling_params import SglSamplingParams
from sglite.lang.tracer import TracerProgramState, TracingScope, trace_program


class SglFunction:
    """A program: the function decorated with `@sgl.function`.

    Invariant: the function's first parameter is named `s` (the program state). `bind(**kw)`
    fixes arguments; `run` executes once, `run_batch` many times in a thread pool, `trace` builds
    the expression graph without a model. Calling the object is `run` (or `trace` while tracing).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments: dict[str, Any] = dict(bind_arguments or {})
        spec = inspect.getfullargspec(func)
        if not spec.args or spec.args[0] != "s":
            raise TypeError(
                f"the first argument of an @sgl.function must be named 's' (the program state); "
                f"{getattr(func, '__name__', func)} has {spec.args[:1] or 'none'}"
            )
        self.arg_names: list[str] = spec.args[1:]
        self.arg_defaults: tuple[Any, ...] = tuple(spec.defaults or ())
        self.__name__ = getattr(func, "__name__", "sgl_function")
        self.__doc__ = getattr(func, "__doc__", None)

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy of this program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}() has no argument(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        min_new_tokens: int = 0,
        n: int = 1,
        stop: str | list[str] | None = (),
        stop_token_ids: list[int] | None = (),
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Any = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once with these arguments; the sampling keywords are the defaults of
        every `gen` that does not set them. Returns the program state at once (generations may
        still be running: reading `state["x"]` waits for `x`). With `stream=True` the function
        body itself runs on a thread so `state.text_iter()` can follow it.
        """
        defaults = SglSamplingParams(
            max_new_tokens, min_new_tokens, n, stop, stop_token_ids, stop_regex, temperature,
            top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
            logprob_start_len, top_logprobs_num, return_text_in_logprobs,
        )  # fmt: skip
        return run_program(self, backend, args, kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]] | Sequence[Sequence[Any]],
        *,
        max_new_tokens: int = 128,
        min_new_tokens: int = 0,
        n: int = 1,
        stop: str | list[str] | None = (),
        stop_token_ids: list[int] | None = (),
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
    ) -> list[ProgramState] | Any:
        """Run the program once per argument set, in a thread pool, and return the finished
        states in input order (a generator of them with `generator_style=True`).

        Each item is a dict of keyword arguments or a tuple of positional ones. A program that
        fails does not stop the batch: its state's `error()` holds the exception. Before the
        batch starts, the constant prefix shared by every run (found by tracing) is sent to the
        cache once.
        """
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or tuples)")
        if len(batch_kwargs) == 0:
            return []
        batch = [self._as_kwargs(item) for item in batch_kwargs]
        defaults = SglSamplingParams(
            max_new_tokens, min_new_tokens, n, stop, stop_token_ids, stop_regex, temperature,
            top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
            logprob_start_len, top_logprobs_num, return_text_in_logprobs,
        )  # fmt: skip
        return run_program_batch(
            self, backend, batch, defaults, num_threads, progress_bar, generator_style
        )

    def _as_kwargs(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, (list, tuple)):
            required = len(self.arg_names) - len(self.arg_defaults)
            if not required <= len(item) <= len(self.arg_names):
                raise TypeError(
                    f"{self.__name__}() takes {required} to {len(self.arg_names)} arguments, "
                    f"a batch item has {len(item)}"
                )
            return dict(zip(self.arg_names, item))
        raise TypeError(f"a run_batch item must be a dict or a tuple, got {type(item).__name__}")

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TracerProgramState:
        """Build the program's expression graph without running the model.

        Arguments not given are placeholders (`SglArgument`); returns the tracer state, whose
        `flatten_nodes()` lists the expressions in order.
        """
        return trace_program(self, kwargs, backend)

    def cache(self, backend: Any = None) -> None:
        """Send the program's constant prefix (found by tracing) to the backend's cache."""
        cache_program(self, backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scope = TracingScope.get_current_scope()
        if scope is None:
            return self.run(*args, **kwargs)
        kwargs.setdefault("backend", scope.tracer_state.backend)
        return self.trace(**dict(zip(self.arg_names, args)), **kwargs)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"
