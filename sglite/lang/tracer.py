"""Tracing: run a program's body against a recording state instead of a model.

`trace_program` records every expression (constant text, generations, selects, roles, forks) as
a graph of nodes linked by `prev_node`; arguments that are not given are `SglArgument`
placeholders and variables read back are `SglVariable` references. `extract_prefix_by_tracing`
stops at the first thing that is not constant text and returns the text before it: the prefix
every run of the program shares, which `run_batch` sends to the cache once before the batch.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from sglite.lang.ir import (
    SglArgument,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglFork,
    SglGen,
    SglGetForkItem,
    SglRoleBegin,
    SglRoleEnd,
    SglSegment,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
)
from sglite.lang.program_state import ProgramState, ProgramStateGroup

logger = logging.getLogger(__name__)


class StopTracing(Exception):
    """Raised inside a traced body once the constant prefix has ended."""


def extract_prefix_by_tracing(program: Any, backend: Any) -> str:
    """The constant text every run of `program` starts with ("" if none).

    Never raises: a body that fails on placeholder arguments simply ends the prefix there.
    """
    arguments: dict[str, Any] = {name: SglArgument(name, None) for name in program.arg_names}
    arguments.update(program.bind_arguments)
    tracer = TracerProgramState(backend, arguments, only_trace_prefix=True)
    try:
        with TracingScope(tracer):
            tracer.ret_value = program.func(tracer, **arguments)
    except StopTracing:
        pass
    except Exception as exc:  # e.g. an f-string of a placeholder: the prefix ends there
        logger.debug("tracing %s stopped: %r", getattr(program, "__name__", program), exc)
    prefix = ""
    for node in tracer.flatten_nodes():
        if not isinstance(node, SglConstantText):
            break
        prefix += node.value
    return prefix


def trace_program(program: Any, arguments: dict[str, Any], backend: Any) -> TracerProgramState:
    """Trace `program` with `arguments` (missing ones become placeholders); returns the tracer
    state holding the recorded nodes. Errors in the body propagate."""
    from sglite.lang.backend.base import BaseBackend
    from sglite.lang.global_config import global_config

    if backend is None:
        backend = global_config.default_backend
    if backend is None:
        backend = BaseBackend()
    arguments = dict(arguments)
    for name in program.arg_names:
        arguments.setdefault(name, SglArgument(name, None))
    arguments.update(program.bind_arguments)
    tracer = TracerProgramState(backend, arguments, only_trace_prefix=False)
    with TracingScope(tracer):
        tracer.ret_value = program.func(tracer, **arguments)
    return tracer


class TracerProgramState(ProgramState):
    """A program state that records expressions instead of executing them.

    Invariants: `nodes` holds the expressions appended to this state in order; each node's
    `prev_node` is the node before it (a fork item's is the fork); roles render through the
    backend's chat template exactly as the interpreter would, so traced text equals run text.
    """

    def __init__(self, backend: Any, arguments: dict[str, Any], only_trace_prefix: bool) -> None:
        from sglite.lang.backend.engine_backend import as_backend

        self.pid = uuid.uuid4().hex
        self.backend = as_backend(backend)
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.stream_executor = None  # type: ignore[assignment]
        self.ret_value: Any = None

        self.nodes: list[SglExpr] = []
        self.last_node: SglExpr | None = None
        self.variables: dict[str, Any] = {}
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: str | None = None
        self.chat_template = self.backend.get_chat_template()
        self.child_states: list[TracerProgramState] = []

        scope = TracingScope.get_current_scope()
        if scope is not None:
            scope.add_child_state(self)

    # ------------------------------------------------------------------ public API
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        if self.only_trace_prefix:
            raise StopTracing()
        fork_node = SglFork(size)
        fork_node.prev_node = self.last_node
        states = []
        for i in range(size):
            state = TracerProgramState(self.backend, self.arguments, self.only_trace_prefix)
            item = SglGetForkItem(i)
            item.prev_node = fork_node
            state.last_node = item
            state.variables = dict(self.variables)
            state.messages_ = list(self.messages_)
            state.cur_role = self.cur_role
            state.chat_template = self.chat_template
            states.append(state)
        return TracerProgramStateGroup(states, self)

    def get_var(self, name: str) -> Any:
        value = self.arguments.get(name)
        if value is not None:
            return value
        var = self.variables[name]
        return SglVariable(var.name, var.source)

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def text(self) -> str:
        """The constant text traced so far (placeholders and generations omitted)."""
        return "".join(n.value for n in self.flatten_nodes() if isinstance(n, SglConstantText))

    def messages(self) -> list[dict[str, Any]]:
        return self.messages_

    def sync(self) -> None:
        pass

    def error(self) -> None:
        return None

    def flatten_nodes(self) -> list[SglExpr]:
        """The recorded expressions with lists expanded, in order."""
        out: list[SglExpr] = []

        def walk(node: SglExpr) -> None:
            if isinstance(node, SglExprList):
                for child in node.expr_list:
                    walk(child)
            else:
                out.append(node)

        for node in self.nodes:
            walk(node)
        return out

    # ------------------------------------------------------------------ recording
    def _submit(self, expr: Any) -> None:
        self._execute(as_expr(expr))

    def __iadd__(self, other: Any) -> TracerProgramState:
        if other is None:
            raise ValueError("Tried to append None to state.")
        self._execute(as_expr(other))
        return self

    def _append_node(self, node: SglExpr) -> None:
        self.nodes.append(node)
        node.prev_node = self.last_node
        self.last_node = node

    def _execute(self, expr: SglExpr) -> None:
        expr.pid = self.pid
        if isinstance(expr, SglConstantText):
            self._append_node(expr)
        elif isinstance(expr, SglSegment):  # text, as far as the prefix is concerned
            self._append_node(SglConstantText(expr.text))
        elif isinstance(expr, SglExprList):
            for child in expr.expr_list:
                self._execute(child)
        elif isinstance(expr, (SglGen, SglSelect)):
            kind = "gen" if isinstance(expr, SglGen) else "select"
            name = expr.name if expr.name is not None else f"{kind}_{len(self.variables)}"
            self.variables[name] = SglVariable(name, source=expr)
            self._append_node(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr)
        elif isinstance(expr, SglVarScopeBegin):
            self._append_node(expr)
        elif isinstance(expr, SglVarScopeEnd):
            self._append_node(expr)
            self.variables[expr.name] = SglVariable(expr.name, source=expr)
        elif self.only_trace_prefix:
            raise StopTracing()
        else:
            self._append_node(expr)

    def _role_begin(self, expr: SglRoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"Nested roles are not allowed ({expr.role!r} in {self.cur_role!r})")
        template = self.chat_template
        if not self.messages_ and expr.role != "system":
            if template.default_system_prompt is not None:
                self._role_begin(SglRoleBegin("system"))
                self._append_node(SglConstantText(template.default_system_prompt))
                self._role_end(SglRoleEnd("system"))
        self.cur_role = expr.role
        prefix, _ = template.get_prefix_and_suffix(expr.role, self.messages_)
        self._append_node(SglConstantText(prefix))

    def _role_end(self, expr: SglRoleEnd) -> None:
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._append_node(SglConstantText(suffix))
        self.messages_.append({"role": expr.role, "content": ""})
        self.cur_role = None

    def __del__(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"TracerProgramState({len(self.nodes)} nodes)"


class TracerProgramStateGroup(ProgramStateGroup):
    """Traced fork branches: `join` records the merge instead of waiting for branches."""

    def join(self, mode: str = "gather_variable") -> None:
        src = self.src_state
        assert isinstance(src, TracerProgramState)
        if mode == "gather_variable":
            known = set(src.variables)
            for state in self.states:
                for name, var in state.variables.items():
                    if name not in known:
                        src.variables.setdefault(name, []).append(var)
        elif mode == "concate_and_append":
            src._execute(SglConcateAndAppend(self.states))
        else:
            raise ValueError(
                f"invalid join mode {mode!r}: use gather_variable or concate_and_append"
            )


class TracingScope:
    """The tracer states being traced on this thread, innermost last (an `@sgl.function` called
    inside a traced body is traced into the same scope). Per thread, so tracing never changes
    what a program running on another thread does."""

    _local = threading.local()

    def __init__(self, tracer_state: TracerProgramState) -> None:
        self.tracer_state = tracer_state
        self.last_scope = TracingScope.get_current_scope()

    def __enter__(self) -> TracingScope:
        TracingScope._local.scope = self
        return self

    def __exit__(self, *exc: Any) -> None:
        TracingScope._local.scope = self.last_scope

    @staticmethod
    def get_current_scope() -> TracingScope | None:
        return getattr(TracingScope._local, "scope", None)

    def add_child_state(self, state: TracerProgramState) -> None:
        scope: TracingScope | None = self
        while scope is not None:
            scope.tracer_state.child_states.append(state)
            scope = scope.last_scope
