"""Pythonic calls (Llama 3.2 / 4 pythonic templates): `[get_weather(city="Paris"), now()]`,
keyword arguments with literal values."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from sglite.runtime.tool_calls.base import JSON_LAYOUT, ToolCallFormat, lark_string
from sglite.runtime.tool_calls.types import RegionParse, ToolCall

_CALL_START = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\(")
_MAYBE_CALL = re.compile(r"\s*(\[\s*([A-Za-z_][\w.]*)?)?")
# JSON's literals written where Python's are expected.
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def _schema_text(schema: dict[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT})


class PythonicFormat(ToolCallFormat):
    name = "pythonic"
    leading = ("[",)

    def detect(self, chat_template: str) -> bool:
        return "[func_name1(" in chat_template or "func_name1(params_name1" in chat_template

    def region_start(self, text: str) -> int | None:
        return len(text) - len(text.lstrip()) if _CALL_START.match(text) else None

    def held_back(self, text: str) -> int:
        # Output that may still become `[name(`: nothing of it is text yet.
        return len(text) if _MAYBE_CALL.fullmatch(text) else 0

    def parse_region(self, region: str) -> RegionParse:
        try:
            tree = ast.parse(region.strip(), mode="eval").body
        except SyntaxError:
            return RegionParse([], 0, False)
        if not isinstance(tree, ast.List) or not tree.elts:
            return RegionParse([], 0, False)
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return RegionParse([], 0, False)
            try:
                args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
            except (ValueError, TypeError, SyntaxError):
                return RegionParse([], 0, False)
            calls.append(ToolCall(ast.unparse(node.func), json.dumps(args)))
        return RegionParse(calls, len(calls), True)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, allow_text: bool) -> str:
        options = []
        for i, tool in enumerate(tools):
            function = tool["function"]
            props = (function.get("parameters") or {}).get("properties") or {}
            required = set((function.get("parameters") or {}).get("required") or [])
            args = [
                f"{lark_string(key + '=')} %json {_schema_text(schema)}"
                for key, schema in props.items()
                if key in required
            ]
            body = ' ", " '.join(args)
            options.append(f'call{i}: {lark_string(function["name"] + "(")} {body} ")"')
        names = " | ".join(f"call{i}" for i in range(len(tools)))
        lines = [
            'calls: "[" call (", " call)* "]"' if parallel else 'calls: "[" call "]"',
            f"call: {names}",
            *options,
        ]
        if allow_text:
            return "\n".join(["start: TEXT | calls", "TEXT: /([^\\[](.|\\n)*)?/", *lines])
        return "\n".join(["start: calls", *lines])
