"""The worker-thread half of a program state's executor: running each kind of expression.

`StreamExecutorWorker` is a mixin of `StreamExecutor` (`stream_executor.py`), which owns the
state, the queue and the submission and reading side; here the worker loop takes expressions
off the queue and runs them: text, images and segments are appended, gens and selects call the
backend, roles render through the chat template, variable scopes capture text, joins append the
forks' text.

Invariants: the mixin holds no state of its own (every field it uses is created by
`StreamExecutor.__init__`) and only the worker thread runs these methods (API speculation,
`backend/api_speculative*.py`, calls them from inside `_execute`); fields that callers read are
written under `_cond`, which is notified on every change.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sglite.lang.global_config import global_config
from sglite.lang.ir import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSegment,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
)
from sglite.lang.sampling_params import SglSamplingParams
from sglite.lang.tools import parse_tool_calls

logger = logging.getLogger(__name__)


class StreamExecutorWorker:
    """The worker side of `StreamExecutor`: the loop and the execution of each expression.

    Besides the executor's fields it uses the executor's `record_error`, `_release_events` and
    `_notify` (defined with the state they guard, in `stream_executor.py`).
    """

    def _worker_loop(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is None:
                break
            try:
                if self.error_ is None:
                    self._execute(expr)
            except Exception as exc:
                logger.warning("program state %s failed (see its error()): %s", self.sid[:8], exc)
                self.record_error(exc)
            finally:
                if self.error_ is not None:
                    self._release_events()
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
        with self._cond:
            self.is_finished = True
            self._cond.notify_all()

    def _execute(self, expr: SglExpr) -> None:
        if self.api_spec is not None and self.api_spec.intercept(self, expr):
            return
        if isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglExprList):
            for child in expr.expr_list:
                self._execute(child)
        elif isinstance(expr, SglImage):
            with self._cond:
                self.images_.append(expr.source)
            self._fill(self.chat_template.image_token)
        elif isinstance(expr, SglSegment):
            start = len(self.text_)
            self._fill(expr.text)
            if expr.text:
                with self._cond:
                    self.segments_.append((start, start + len(expr.text)))
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._execute_role_begin(expr)
        elif isinstance(expr, SglRoleEnd):
            self._execute_role_end(expr)
        elif isinstance(expr, SglVariable):
            self._fill(expr.source.get_var(expr.name))
        elif isinstance(expr, SglVarScopeBegin):
            self._scope_starts[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            start = self._scope_starts.pop(expr.name, len(self.text_))
            self._store(expr.name, self.text_[start:], None)
        elif isinstance(expr, SglCommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(expr, SglConcateAndAppend):
            self._execute_concatenate_and_append(expr)
        else:
            raise TypeError(f"cannot execute {expr!r} (tracing-only expressions cannot run)")

    def _fill(self, value: Any) -> None:
        with self._cond:
            self.text_ += str(value)
            self._cond.notify_all()

    def _store(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        event = self.variable_event.get(name)
        if event is None:
            event = self.variable_event[name] = threading.Event()
        event.set()
        self._notify()

    def _resolve_sampling_params(self, params: SglSamplingParams) -> SglSamplingParams:
        """The run's defaults overridden by the gen's own settings; inside an assistant turn
        the chat template's stop strings are added (the turn ends where the template says)."""
        merged = self.default_sampling_para.merged_with(params)
        if self.cur_role == "assistant" and self.chat_template.stop_str:
            stops = merged.stop_list()
            merged.stop = stops + [s for s in self.chat_template.stop_str if s not in stops]
        return merged

    def _execute_gen(self, expr: SglGen) -> None:
        params = self._resolve_sampling_params(expr.sampling_params)
        name = expr.name
        if not self.stream or (params.n or 1) > 1:
            comp, meta = self.backend.generate(self, params)
            self._fill(comp[0] if isinstance(comp, list) else comp)
            self._store(name, comp, _with_tool_calls(expr, comp, meta))
            return
        if name is not None:
            self.variables[name] = ""
        meta = None
        for chunk, meta in self.backend.generate_stream(self, params):
            with self._cond:
                self.text_ += chunk
                if name is not None:
                    self.variables[name] += chunk
                    self.meta_info[name] = meta
                self._cond.notify_all()
        if name is not None:
            self._store(
                name, self.variables[name], _with_tool_calls(expr, self.variables[name], meta)
            )

    def _execute_select(self, expr: SglSelect) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._fill(decision.decision)
        self._store(expr.name, decision.decision, decision.meta_info)

    def _execute_role_begin(self, expr: SglRoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"Nested roles are not allowed ({expr.role!r} in {self.cur_role!r})")
        template = self.chat_template
        if not self.messages_ and expr.role != "system":
            if template.default_system_prompt is not None:
                self._execute_role_begin(SglRoleBegin("system"))
                self._fill(template.default_system_prompt)
                self._execute_role_end(SglRoleEnd("system"))
        prefix, _ = template.get_prefix_and_suffix(expr.role, self.messages_)
        self._fill(prefix)
        self.cur_role = expr.role
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, expr: SglRoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"cannot end a {expr.role!r} turn: the open turn is {self.cur_role!r}")
        begin = self.cur_role_begin_pos if self.cur_role_begin_pos is not None else len(self.text_)
        content = self.text_[begin:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None

    def _execute_concatenate_and_append(self, expr: SglConcateAndAppend) -> None:
        new_text = ""
        for state in expr.states:
            child = state.stream_executor
            child.sync()
            if child.error_ is not None:
                raise RuntimeError(f"a joined fork failed: {child.error_}") from child.error_
            new_text += child.text_[child.fork_start_text_pos or 0 :]
        self._fill(new_text)
        if global_config.enable_parallel_encoding and self.backend.support_concate_and_append:
            # Backends that keep per-request KV state are told which requests were joined;
            # with a radix cache the text alone is enough, so this is a notification.
            src = [state.stream_executor.sid for state in expr.states]
            self.backend.concatenate_and_append(src, self.sid)


def _with_tool_calls(expr: SglGen, text: Any, meta: Any) -> Any:
    """`meta` with the calls parsed out of a tools gen's output (`tool_calls`)."""
    if not expr.tools:
        return meta
    outputs = text if isinstance(text, list) else [text]
    calls = [parse_tool_calls(t) for t in outputs]
    meta = dict(meta or {})
    meta["tool_calls"] = calls if isinstance(text, list) else calls[0]
    return meta
