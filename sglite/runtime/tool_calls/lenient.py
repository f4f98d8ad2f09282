"""Lenient `auto` tool calls: an answer that is nothing but one call object.

Small tool models often answer a tools request with the call written as plain JSON (bare, or in
a Markdown code fence) instead of their own call syntax. Such an answer is taken as a call only
when it is exactly one JSON object `{"name": <a declared tool>, "arguments" | "parameters":
{...}}` whose arguments validate against that tool's `parameters` schema; any other text, a
second object, an unknown name or arguments that do not validate leave the answer as text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sglite.runtime.tool_calls.types import ToolCall

# One fenced block (``` or ```json) holding the whole answer.
_FENCED = re.compile(r"\A```[A-Za-z]*[ \t]*\n(?P<body>.*?)\n?```\Z", re.DOTALL)
_ARGUMENT_KEYS = ("arguments", "parameters")


def may_become_call(text: str) -> bool:
    """Whether an output that begins with `text` may still turn out to be a lenient call (a
    stream holds such text back until the output is finished): empty, an object, or a fence
    of no language or JSON whose body is empty so far or an object."""
    stripped = text.lstrip()
    if not stripped or stripped.startswith("{") or "```".startswith(stripped):
        return True
    if not stripped.startswith("```"):
        return False
    info, newline, body = stripped[3:].partition("\n")
    language = info.strip().lower()
    if not newline:  # the language may still be being written
        return "json".startswith(language)
    return language in ("", "json") and (not body.strip() or body.lstrip().startswith("{"))


def lenient_call(text: str, tools: list[dict[str, Any]]) -> ToolCall | None:
    """The call `text` is, by the rule in the module docstring, else None."""
    body = text.strip()
    fenced = _FENCED.match(body)
    if fenced is not None:
        body = fenced.group("body").strip()
    if not body.startswith("{"):
        return None
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    keys = [k for k in _ARGUMENT_KEYS if k in value]
    if set(value) != {"name", *keys} or len(keys) != 1:
        return None
    arguments = value[keys[0]]
    tool = next((t for t in tools if t["function"]["name"] == value["name"]), None)
    if tool is None or not isinstance(arguments, dict) or not _valid(arguments, tool):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _valid(arguments: dict[str, Any], tool: dict[str, Any]) -> bool:
    import jsonschema

    schema = tool["function"].get("parameters") or {"type": "object"}
    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return False  # a schema that cannot judge the arguments accepts no call
    return True
