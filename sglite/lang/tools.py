"""Tools in LM programs: `sgl.gen(name, tools=[...])` makes the model call one of them.

A tool is a Python function (its JSON schema read from the signature and docstring,
`function_tool`) or an OpenAI tool object. The call is written in the Hermes format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and enforced by the runtime's grammar
engine with each tool's argument schema, so it always parses; `state.tool_calls(name)` returns
the calls, and `sgl.tools_prompt(tools)` is a system-prompt paragraph describing the tools.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any, get_args, get_origin, get_type_hints

from sglite.runtime.tool_calls.hermes import HermesFormat

Tool = Callable[..., Any] | dict[str, Any]
_FORMAT = HermesFormat()
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object"}  # fmt: skip


def _schema_of(annotation: Any) -> dict[str, Any]:
    origin = get_origin(annotation) or annotation
    if origin in _JSON_TYPES:
        schema: dict[str, Any] = {"type": _JSON_TYPES[origin]}
        args = get_args(annotation)
        if origin is list and args:
            schema["items"] = _schema_of(args[0])
        return schema
    return {}  # unannotated or unknown: any JSON value


def function_tool(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool object of a Python function: its name, the docstring's first paragraph,
    and its parameters' JSON schema (annotated str/int/float/bool/list/dict; those without a
    default are required)."""
    properties, required = {}, []
    try:  # string annotations (`from __future__ import annotations`) resolved
        hints = get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{fn.__name__}: tools take named parameters, not *{name}")
        properties[name] = _schema_of(hints.get(name, param.annotation))
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    function = {
        "name": fn.__name__,
        "description": doc.split("\n\n")[0].strip(),
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        },
    }
    return {"type": "function", "function": function}


def as_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """OpenAI tool objects for functions and tool objects alike."""
    out = []
    for tool in tools:
        if callable(tool):
            out.append(function_tool(tool))
        elif isinstance(tool, dict) and "function" in tool:
            out.append(tool)
        else:
            raise TypeError(f"a tool is a function or an OpenAI tool object, got {tool!r}")
    return out


def tool_grammar(tools: list[Tool], tool_choice: str, parallel: bool) -> str:
    """The Lark grammar (for the runtime's llguidance) of calls of `tools`: one call (or several
    with `parallel`) for `required` or a function name; text or calls for `auto`."""
    specs = as_tools(tools)
    if tool_choice not in ("auto", "required"):
        specs = [s for s in specs if s["function"]["name"] == tool_choice]
        if not specs:
            raise ValueError(f"tool_choice {tool_choice!r} names none of the tools")
        parallel = False
    return _FORMAT.grammar(specs, parallel, allow_text=tool_choice == "auto")


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The calls in generated text: `[{"id", "name", "arguments"}]` with arguments as a dict."""
    return [
        {"id": c.id, "name": c.name, "arguments": json.loads(c.arguments)}
        for c in _FORMAT.parse(text).calls
    ]


def tools_prompt(tools: list[Tool]) -> str:
    """A system-prompt paragraph describing `tools` and the call format."""
    listing = "\n".join(json.dumps(t["function"]) for t in as_tools(tools))
    return (
        f"You can call these functions; their parameters are JSON schemas:\n{listing}\n"
        'To call one, reply with <tool_call>{"name": <function name>, "arguments": '
        "<JSON object>}</tool_call>."
    )


def call_tool(tools: list[Tool], call: dict[str, Any]) -> Any:
    """Run the Python function a parsed call names with its arguments."""
    for tool in tools:
        if callable(tool) and tool.__name__ == call["name"]:
            return tool(**call["arguments"])
    raise KeyError(f"no Python function named {call['name']!r} among the tools")
