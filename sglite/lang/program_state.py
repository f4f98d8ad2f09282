"""`ProgramState`, the `s` of a program (`s += expr`, `s["x"]`, roles, forks, streaming), and
`ProgramStateGroup`, the branches of a fork; each state's expressions run on its
`StreamExecutor` (`stream_executor.py`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from sglite.lang.ir import (
    SglConcateAndAppend,
    SglExpr,
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
)
from sglite.lang.stream_executor import StreamExecutor


class ProgramState:
    """The `s` of a program: append expressions, read variables, fork, stream.

    `s += expr` never blocks (except to reject misnested roles); reads (`s["x"]`, `text()`,
    `messages()`, `error()`) wait for the work they depend on.
    """

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    def _submit(self, expr: Any) -> None:
        self.stream_executor.submit(expr)

    # ------------------------------------------------------------------ roles
    def _role_common(self, name: str, expr: Any = None) -> Any:
        if expr is not None:
            role_expr = SglExprList([SglRoleBegin(name), as_expr(expr), SglRoleEnd(name)])
            self._submit(role_expr)
            return role_expr

        @contextmanager
        def role_scope() -> Iterator[None]:
            self._submit(SglRoleBegin(name))
            try:
                yield
            finally:
                self._submit(SglRoleEnd(name))

        return role_scope()

    def system(self, expr: Any = None) -> Any:
        """Append a system turn holding `expr`, or (no argument) a `with` block for one."""
        return self._role_common("system", expr)

    def user(self, expr: Any = None) -> Any:
        """Append a user turn holding `expr`, or (no argument) a `with` block for one."""
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        """Append an assistant turn holding `expr`, or (no argument) a `with` block for one."""
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Capture the text appended inside the block as variable `name`."""
        self._submit(SglVarScopeBegin(name))
        try:
            yield
        finally:
            self._submit(SglVarScopeEnd(name))

    # ------------------------------------------------------------------ fork
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` branches continuing from here, run in parallel; see `ProgramStateGroup.join`."""
        executors = self.stream_executor.fork(size, position_ids_offset)
        return ProgramStateGroup([ProgramState(e) for e in executors], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[ProgramState]:
        """A `with` block over one branch of this state, joined (variables gathered) at exit."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ------------------------------------------------------------------ reading
    def text(self) -> str:
        """The whole text so far (waits for pending work)."""
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        """The finished chat turns as OpenAI-style `{"role", "content"}` dicts."""
        return self.stream_executor.messages()

    def sync(self) -> None:
        """Wait for every pending expression."""
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped the program, or None."""
        return self.stream_executor.error()

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def tool_calls(self, name: str) -> list[dict[str, Any]]:
        """The calls a `gen(name, tools=...)` made: `[{"id", "name", "arguments"}]`, arguments
        as a dict (run them with `sglite.lang.tools.call_tool`)."""
        meta = self.stream_executor.get_meta_info(name) or {}
        if "tool_calls" not in meta:
            raise KeyError(f"{name!r} is not a gen with tools")
        return meta["tool_calls"]

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta info of variable `name`: for a gen the `/generate` answer's
        `meta_info` (tokens, cached tokens, finish reason, logprobs if asked); for a select the
        scores of every choice."""
        return self.stream_executor.get_meta_info(name)

    # ------------------------------------------------------------------ streaming
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the program's text (or one variable's) as it grows.

        For a state not run with `stream=True`, yields the final text (or value) once.
        """
        exe = self.stream_executor
        if not exe.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        pos = 0
        while True:
            with exe._cond:
                exe._cond.wait_for(functools.partial(self._stream_ready, var_name, pos))
                current, done = self._stream_view(var_name)
            if len(current) > pos:
                yield current[pos:]
                pos = len(current)
            if done:
                return

    def _stream_view(self, var_name: str | None) -> tuple[str, bool]:
        exe = self.stream_executor
        if var_name is None:
            return exe.text_, exe.is_finished
        value = exe.variables.get(var_name, "")
        event = exe.variable_event.get(var_name)
        done = exe.is_finished or (event is not None and event.is_set())
        return (value if isinstance(value, str) else str(value)), done

    def _stream_ready(self, var_name: str | None, pos: int) -> bool:
        current, done = self._stream_view(var_name)
        return done or len(current) > pos

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for asyncio: waiting happens on a thread, so the event loop stays free.

        With `return_meta_data` (and a variable name) yields `(chunk, meta_info)` pairs.
        """
        loop = asyncio.get_running_loop()
        it = self.text_iter(var_name)
        done = object()
        while True:
            chunk = await loop.run_in_executor(None, next, it, done)
            if chunk is done:
                return
            if return_meta_data and var_name is not None:
                yield chunk, self.stream_executor.meta_info.get(var_name)
            else:
                yield chunk

    # ------------------------------------------------------------------ operators
    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("Tried to append None to state.")
        self._submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return self.stream_executor.has_var(name)

    def __del__(self) -> None:
        executor = getattr(self, "stream_executor", None)
        if executor is not None:
            try:
                executor.end()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork. `group[i]` is one branch; `group += expr` appends to every
    branch (a callable receives the branch index, a list gives one item per branch)."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None):
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and merge it into the source state, then end the branches.

        - `gather_variable`: each variable a branch created becomes, in the source, the list of
          its values across branches (branch order).
        - `concate_and_append`: the text each branch produced after the fork is appended to the
          source, in branch order.
        """
        if self.src_state is None:
            raise ValueError("this group has no source state to join into")
        src = self.src_state.stream_executor
        if mode == "gather_variable":
            src.sync()
            known = set(src.variables)
            for state in self.states:
                child = state.stream_executor
                child.sync()
                for name, value in child.variables.items():
                    if name in known:
                        continue
                    src.variables.setdefault(name, []).append(value)
                    src.meta_info.setdefault(name, []).append(child.meta_info.get(name))
        elif mode == "concate_and_append":
            self.src_state += SglConcateAndAppend(self.states)
            src.sync()
        else:
            raise ValueError(
                f"invalid join mode {mode!r}: use gather_variable or concate_and_append"
            )
        for state in self.states:
            state.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += expr` assigns the same state back; anything else is a mistake.
        if self.states[i] is not value:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, SglExpr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (SglExpr, str)):
            for state in self.states:
                state += other
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} branches")
            for state, item in zip(self.states, other):
                state += item
        else:
            raise TypeError(f"cannot append {type(other).__name__} to fork branches")
        return self
