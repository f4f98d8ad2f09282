"""The executor of one program state: expressions run in submission order on a worker thread.

`s += gen("x")` hands the expression to the state's `StreamExecutor` and returns at once; reading
`s["x"]` waits on `x`'s event. Forks are independent executors (each with its own thread), so
branches generate in parallel; the fork point is first sent to the runtime as a prefill-only
request so every branch hits the cache.

Errors: an expression that fails stores the exception (`s.error()`); the executor then skips the
rest of the program but still releases every waiter, so nothing blocks forever.

This module holds the executor's state and its caller side (submitting, reading, forking); how
the worker runs each kind of expression is in `stream_executor_worker.py` (a mixin).
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from sglite.lang.ir import (
    SglCommitLazy,
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVarScopeBegin,
    as_expr,
)
from sglite.lang.sampling_params import SglSamplingParams
from sglite.lang.stream_executor_worker import StreamExecutorWorker

logger = logging.getLogger(__name__)


class StreamExecutor(StreamExecutorWorker):
    """Executes one program state's expressions, in order, on a worker thread.

    Invariants: expressions run in submission order; a variable's event is set exactly when its
    final value is stored or it can no longer be produced (after an error); `text_` only grows,
    except through `set_var`. Shared fields are written by the worker and read by callers after
    `sync()` or under `_cond`.
    """

    def __init__(
        self,
        backend: Any,
        arguments: dict[str, Any],
        default_sampling_para: SglSamplingParams,
        chat_template: Any = None,
        stream: bool = False,
        num_api_spec_tokens: int | None = None,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        # API speculative execution (backend/api_speculative.py): sees every expression first.
        # Streaming runs every gen as its own call, so it has none.
        self.api_spec: Any = None
        if num_api_spec_tokens is not None and not stream:
            new_spec = getattr(backend, "new_api_speculation", None)
            self.api_spec = new_spec(num_api_spec_tokens) if new_spec is not None else None

        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.error_: BaseException | None = None
        self.is_finished = False

        self.text_ = ""
        self.images_: list[str] = []  # sources of the images in text_, in order (image_data)
        self.segments_: list[tuple[int, int]] = []  # sgl.segment character spans of text_
        self.messages_: list[dict[str, Any]] = []
        self.chat_template = chat_template or backend.get_chat_template()
        self.cur_role: str | None = None  # the worker's view of the open role
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self._scope_starts: dict[str, int] = {}
        # The submitter's view of the open role: nesting is rejected when it is written, not
        # later on the worker, so the error points at the offending line.
        self._submitted_role: str | None = None

        self._cond = threading.Condition()  # guards _pending/_ended; notified on every change
        self._pending = 0
        self._ended = False
        self._queue: queue.SimpleQueue[SglExpr | None] = queue.SimpleQueue()
        self._worker = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._worker_loop,),
            daemon=True,
            name=f"sgl-state-{self.sid[:8]}",
        )
        self._worker.start()

    # ------------------------------------------------------------------ submission side
    def submit(self, expr: Any) -> None:
        """Queue `expr` for execution. Raises ValueError for misnested roles and RuntimeError
        if the state has ended (e.g. a fork already joined)."""
        expr = as_expr(expr)
        self._check_roles(expr)
        with self._cond:
            if self._ended:
                raise RuntimeError(
                    "this program state has ended (its program returned, or it is a joined "
                    "fork); fork it to continue from its text"
                )
            self._init_var_events(expr)
            self._pending += 1
        self._queue.put(expr)

    def _check_roles(self, expr: SglExpr) -> None:
        role = self._submitted_role
        for node in _flatten(expr):
            if isinstance(node, SglRoleBegin):
                if role is not None:
                    raise ValueError(
                        f"Nested roles are not allowed: cannot begin a {node.role!r} turn inside "
                        f"the open {role!r} turn; end it first (sgl.{role}_end(), or leave the "
                        f"`with s.{role}():` block)"
                    )
                role = node.role
            elif isinstance(node, SglRoleEnd):
                if role != node.role:
                    open_desc = f"the open turn is {role!r}" if role else "no turn is open"
                    raise ValueError(f"cannot end a {node.role!r} turn: {open_desc}")
                role = None
        self._submitted_role = role

    def _init_var_events(self, expr: SglExpr) -> None:
        for node in _flatten(expr):
            if isinstance(node, (SglGen, SglSelect, SglVarScopeBegin)) and node.name is not None:
                self.variable_event[node.name] = threading.Event()

    def sync(self) -> None:
        """Wait until every submitted expression has run (or been skipped after an error),
        including work a speculative chat turn deferred."""
        self._request_flush()
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def end(self) -> None:
        """No more expressions: the worker exits once the queue is drained. Idempotent."""
        with self._cond:
            if self._ended:
                return
            self._request_flush_locked()  # deferred speculative work runs before the end
            self._ended = True
        self._queue.put(None)
        try:
            self.backend.end_program(self)
        except Exception:  # a backend hook must not turn cleanup into a failure
            logger.debug("end_program failed", exc_info=True)

    def record_error(self, exc: BaseException) -> None:
        """Store `exc` as the program's error (the first one wins) and release every waiter."""
        with self._cond:
            if self.error_ is None:
                self.error_ = exc
            self._cond.notify_all()
        self._release_events()

    def _release_events(self) -> None:
        for event in list(self.variable_event.values()):
            event.set()
        self._notify()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _request_flush(self) -> None:
        """Have deferred speculative work (an open chat turn's gens) run, before a read waits
        on it: an `SglCommitLazy` is queued, which the speculation turns into that work."""
        if self.api_spec is not None and self.api_spec.defers:
            with self._cond:
                if not self._ended:
                    self._request_flush_locked()

    def _request_flush_locked(self) -> None:
        if self.api_spec is not None and self.api_spec.defers:
            self._pending += 1
            self._queue.put(SglCommitLazy())

    # ------------------------------------------------------------------ reading
    def get_var(self, name: str) -> Any:
        """The value of `name`, waiting for it if it is still being produced.

        Raises RuntimeError if the program failed before producing it, KeyError if it was
        never defined.
        """
        event = self.variable_event.get(name)
        if event is not None:
            if not event.is_set():
                self._request_flush()
            event.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise RuntimeError(
                f"variable {name!r} was not produced because the program failed: {self.error_}"
            ) from self.error_
        raise KeyError(name)

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def has_var(self, name: str) -> bool:
        """Whether `name` is (or, once pending work finishes, will be) a variable."""
        event = self.variable_event.get(name)
        if event is not None:
            if not event.is_set():
                self._request_flush()
            event.wait()
        return name in self.variables

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        """The runtime's meta info of variable `name` (None if it has none)."""
        event = self.variable_event.get(name)
        if event is not None and not event.is_set():
            self._request_flush()
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"timed out waiting for variable {name!r}")
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        self.sync()
        return self.error_

    # ------------------------------------------------------------------ fork
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> list[StreamExecutor]:
        """`size` copies of this state at its current end, each with its own worker.

        For size > 1 the text so far is first committed to the runtime (prefill-only) so the
        branches share its cache.
        """
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        if size > 1:
            if self._ended:  # forking a finished run: no worker, commit from here
                self.sync()
                if self.error_ is None:
                    self.backend.commit_lazy_operations(self)
            else:
                self.submit(SglCommitLazy())
        self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend,
                self.arguments,
                self.default_sampling_para,
                self.chat_template,
                self.stream,
                self.num_api_spec_tokens,
            )
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.text_ = self.text_
            child.images_ = list(self.images_)
            child.segments_ = list(self.segments_)
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child._submitted_role = self._submitted_role
            child._scope_starts = dict(self._scope_starts)
            child.fork_start_text_pos = len(self.text_)
            child.error_ = self.error_  # a failed program's branches cannot succeed either
            children.append(child)
        return children

    def __del__(self) -> None:
        try:
            self.end()
        except Exception:
            pass


def _flatten(expr: SglExpr) -> Iterator[SglExpr]:
    if isinstance(expr, SglExprList):
        for child in expr.expr_list:
            yield from _flatten(child)
    else:
        yield expr
