"""The language's intermediate representation: expressions appended to a program state.

A program is a Python function whose first argument `s` is a program state; `s += expr` appends an
expression. The executor (`stream_executor.py`) runs expressions in order on a worker thread;
the tracer (`tracer.py`) records them as a graph without running the model. Both see the same
classes defined here, so what can be traced can be run.

Invariant: this module depends on neither of them (they depend on it). The program object that
ties a function to both, `@sgl.function`'s `SglFunction` with `run` / `run_batch` / `trace`,
lives in `program.py`; a gen's sampling parameters (`SglSamplingParams`, the `REGEX_*` of
`dtype=`) live in `sampling_params.py` and are re-exported here, SGLang's import path for them.
"""

from __future__ import annotations

from typing import Any

from sglite.lang.choices import ChoicesSamplingMethod

# Re-exported: SGLang programs import these from `sglang.lang.ir` (redundant aliases mark them).
from sglite.lang.sampling_params import REGEX_BOOL as REGEX_BOOL
from sglite.lang.sampling_params import REGEX_FLOAT as REGEX_FLOAT
from sglite.lang.sampling_params import REGEX_INT as REGEX_INT
from sglite.lang.sampling_params import REGEX_STR as REGEX_STR
from sglite.lang.sampling_params import SglSamplingParams as SglSamplingParams


class SglExpr:
    """Base of every expression. `a + b` builds an `SglExprList`; strings become constants.

    `node_id` numbers nodes for printing; `prev_node` links a traced node to the one before it.
    """

    _node_count = 0

    def __init__(self) -> None:
        self.node_id = SglExpr._node_count
        SglExpr._node_count += 1
        self.prev_node: SglExpr | None = None
        self.pid: str | None = None

    def __add__(self, other: Any) -> SglExprList:
        return _concat(self, as_expr(other))

    def __radd__(self, other: Any) -> SglExprList:
        return _concat(as_expr(other), self)

    def print_graph_dfs(self) -> str:
        """The graph that leads to this node, one `%id = ...` line per node, dependencies first."""
        lines: list[str] = []
        seen: set[int] = set()

        def visit(node: SglExpr | None) -> None:
            if node is None or id(node) in seen:
                return
            seen.add(id(node))
            visit(node.prev_node)
            if isinstance(node, SglExprList):
                for child in node.expr_list:
                    visit(child)
            elif isinstance(node, SglVariable):
                visit(node.source)
            if isinstance(node, (SglFork, SglGetForkItem)) or node.prev_node is None:
                lines.append(f"%{node.node_id} = {node!r}")
            else:
                lines.append(f"%{node.node_id} = %{node.prev_node.node_id} + {node!r}")

        visit(self)
        return "\n".join(lines) + "\n"


def as_expr(value: Any) -> SglExpr:
    """`value` as an expression: expressions unchanged, strings as constant text.

    Raises TypeError for anything else (a number must be formatted into a string first).
    """
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    if value is None:
        raise ValueError("Tried to append None to the program state")
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program state; use a string or an sgl "
        "expression (gen, select, roles ...)"
    )


def _concat(a: SglExpr, b: SglExpr) -> SglExprList:
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    """Expressions executed one after another."""

    def __init__(self, expr_list: list[SglExpr]) -> None:
        super().__init__()
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglArgument(SglExpr):
    """A placeholder for a program argument while tracing (its value is unknown).

    It refuses f-string formatting so tracing stops where the prefix stops being constant.
    """

    def __init__(self, name: str, value: Any) -> None:
        super().__init__()
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"Argument(name={self.name}, value={self.value!r})"

    def __len__(self) -> int:
        return len(self.value)

    def __getitem__(self, i: Any) -> Any:
        return self.value[i]

    def __int__(self) -> int:
        return self.value

    def __bool__(self) -> bool:
        return bool(self.value)

    def __format__(self, *args: Any) -> str:
        raise TypeError(
            "Cannot put argument inside a f-string. This is not compatible with the tracer."
        )


class SglConstantText(SglExpr):
    """Literal text appended to the prompt."""

    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = str(value)

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglImage(SglExpr):
    """An image in the prompt (vision-language models): the chat template's image token in the
    text, the image sent with the request as `image_data`. `source` is a data: URL (files and
    bytes are encoded into one when the expression is made) or an URL."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def __repr__(self) -> str:
        return f"Image({self.source[:40]!r})"


class SglSegment(SglExpr):
    """Text whose KV the runtime may cache by content and reuse wherever it appears in later
    prompts (a retrieved passage, a tool's output): appended like plain text, sent with the
    request as a segment span (docs/segments.md)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def __repr__(self) -> str:
        return f"Segment({self.text[:40]!r})"


class SglGen(SglExpr):
    """A generation call: the model continues the text; the result is stored under `name`."""

    def __init__(
        self,
        name: str | None = None,
        sampling_params: SglSamplingParams | None = None,
        tools: list[Any] | None = None,
    ):
        super().__init__()
        self.name = name
        self.sampling_params = sampling_params or SglSamplingParams.unset()
        self.tools = tools  # the output is a tool call of these, parsed into meta "tool_calls"

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    """Choose one of `choices` by the model's likelihood (see `choices.py` for the methods)."""

    def __init__(
        self,
        name: str | None,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> None:
        super().__init__()
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return (
            f"Select({self.name!r}, choices={self.choices}, choices_method={self.choices_method})"
        )


class SglRoleBegin(SglExpr):
    """Open a chat turn of `role` (system / user / assistant); roles do not nest."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    """Close the open chat turn of `role`."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    """Start capturing the text appended until the matching end into variable `name`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name!r})"


class SglVarScopeEnd(SglExpr):
    """Stop capturing into variable `name`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name!r})"


class SglVariable(SglExpr):
    """A reference to variable `name` of another state (or, while tracing, of a traced node)."""

    def __init__(self, name: str, source: Any) -> None:
        super().__init__()
        self.name = name
        self.source = source

    def __repr__(self) -> str:
        source = getattr(self.source, "node_id", "?")
        return f"Variable({self.name!r}, source=%{source})"


class SglFork(SglExpr):
    """(Traced) the state splits into `number` branches here."""

    def __init__(self, number: int) -> None:
        super().__init__()
        self.number = number

    def __repr__(self) -> str:
        prev = self.prev_node.node_id if self.prev_node is not None else None
        return f"Fork(%{prev}, number={self.number})"


class SglGetForkItem(SglExpr):
    """(Traced) branch `index` of a fork."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def __repr__(self) -> str:
        prev = self.prev_node.node_id if self.prev_node is not None else None
        return f"GetForkItem(%{prev}, index={self.index})"


class SglConcateAndAppend(SglExpr):
    """Append the text each forked state produced after the fork point (join's second mode)."""

    def __init__(self, states: list[Any]) -> None:
        super().__init__()
        self.states = states

    def __repr__(self) -> str:
        return f"ConcatenateAndAppend({len(self.states)} states)"


class SglCommitLazy(SglExpr):
    """Send the text so far to the runtime as a prefill-only request (fills the cache)."""

    def __repr__(self) -> str:
        return "CommitLazy()"
