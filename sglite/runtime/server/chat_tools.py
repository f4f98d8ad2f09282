"""Tools in a chat request: checking `tools` and `tool_choice`, the prompt they go into, the
grammar that enforces `required`, named and `strict` calls, and the calls parsed out of the answer.

The call format is `--tool-call-parser`, else the one the chat template writes
(`tool_calls.formats.detect_format`). A template that renders no tools gets them described in a
system message in the Hermes format (`<tool_call>{...}</tool_call>`), which is then parsed: so
any model, the default one included, can be asked for tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sglite.http.errors import APIError
from sglite.runtime.server.openai_protocol import ChatCompletionRequest
from sglite.runtime.server.state import ServerState
from sglite.runtime.tool_calls.base import StreamingToolParser, ToolCallFormat
from sglite.runtime.tool_calls.formats import detect_format, get_format
from sglite.runtime.tool_calls.lenient import lenient_call
from sglite.runtime.tool_calls.types import ParsedOutput, StreamDelta, ToolCall

FALLBACK_FORMAT = "hermes"
_SYSTEM_TOOLS = (
    "You can call these functions; their parameters are JSON schemas:\n{tools}\n"
    'To call one, reply with <tool_call>{{"name": <function name>, "arguments": <JSON '
    "object>}}</tool_call> (one block per call) and nothing else."
)


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tools are handled: `tools` go to the chat template, `fmt` parses
    the answer, `grammar` (Lark, for llguidance) constrains it, `eager` streams call pieces as
    they arrive (the grammar guarantees they parse), `describe` puts the tools in a system
    message (the template renders none), `lenient` takes an answer that is one plain call
    object (bare or fenced JSON, `tool_calls/lenient.py`) as that call."""

    tools: list[dict[str, Any]] | None = None
    fmt: ToolCallFormat | None = None
    grammar: str | None = None
    eager: bool = False
    describe: bool = False
    lenient: bool = False  # `auto`: an answer that is one plain call object is a call


def tool_format(state: ServerState) -> tuple[ToolCallFormat, bool]:
    """The server's call format, and whether its chat template renders tools itself."""
    name = state.args.tool_call_parser
    detected = detect_format(state.tokenizer.chat_template)
    if name:
        return get_format(name), detected is not None
    return detected or get_format(FALLBACK_FORMAT), detected is not None


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for i, tool in enumerate(tools):
        field = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{field}.type: only function tools are supported", param=field)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{field}.function.name: required", param=f"{field}.function")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(
                400,
                f"{field}.function.parameters: must be a JSON schema object",
                param=f"{field}.function.parameters",
            )


def _named_tool(tools: list[dict[str, Any]], choice: dict[str, Any]) -> dict[str, Any]:
    function = choice.get("function") if choice.get("type", "function") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            400,
            'tool_choice: expected "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise APIError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")


def _relaxed(tool: dict[str, Any]) -> dict[str, Any]:
    """`tool` unless it is strict: its arguments then only have to be a JSON object."""
    if tool["function"].get("strict"):
        return tool
    function = {**tool["function"], "parameters": {"type": "object"}}
    return {**tool, "function": function}


def _check_grammar(fmt: ToolCallFormat, tools: list[dict[str, Any]], grammar: str) -> None:
    """400 naming the tool whose schema the grammar engine cannot compile."""
    import llguidance

    def broken(text: str) -> str | None:
        compiled = llguidance.LLMatcher.grammar_from_lark(text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
        return messages[0].strip() if is_error else None

    try:
        error = broken(grammar)
    except ValueError as exc:
        error = str(exc)
    if error is None:
        return
    for i, tool in enumerate(tools):
        try:
            one = broken(fmt.grammar([tool], False, False))
        except ValueError as exc:
            one = str(exc)
        if one is not None:
            field = f"tools.{i}.function.parameters"
            raise APIError(400, f"{field}: the schema does not compile: {one}", param=field)
    raise APIError(400, f"tools: the call grammar does not compile: {error}", param="tools")


def plan_tools(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    """Check the request's tools and choice (400 naming the field) and decide how to serve
    them."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        return ToolPlan()
    _check_tools(tools)
    if choice == "none":
        return ToolPlan()
    if (body.n or 1) > 1:
        raise APIError(400, "n: must be 1 when tools are given", param="n")
    fmt, rendered = tool_format(state)
    parallel = body.parallel_tool_calls is not False
    grammar, eager = None, True
    if choice == "required":
        grammar = fmt.grammar(tools, parallel, allow_text=False)
    elif isinstance(choice, dict):
        grammar = fmt.grammar([_named_tool(tools, choice)], False, allow_text=False)
    elif choice in (None, "auto"):
        eager = False
        if any(t["function"].get("strict") for t in tools):
            grammar = fmt.grammar([_relaxed(t) for t in tools], parallel, allow_text=True)
    else:
        raise APIError(
            400,
            f"tool_choice: {choice!r} is not one of none, auto, required or a named function",
            param="tool_choice",
        )
    if grammar is not None:
        if state.client.info.get("grammar_backend") != "llguidance":
            raise APIError(
                400,
                "tool_choice: enforcing calls needs the llguidance grammar backend",
                param="tool_choice",
                code="not_supported",
            )
        _check_grammar(fmt, tools, grammar)
    lenient = choice in (None, "auto") and not state.args.disable_lenient_tool_calls
    return ToolPlan(tools, fmt, grammar, eager and grammar is not None, not rendered, lenient)


def prepare_messages(plan: ToolPlan, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat template gets them: earlier calls' arguments as objects (what
    templates write out), and for templates that render no tools, the tools in a system message
    and earlier calls written into the assistant's text in the call format."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
            if plan.describe:
                text = "\n".join(_hermes_text(c) for c in message["tool_calls"])
                message = {
                    **message,
                    "content": "\n".join(filter(None, [message["content"], text])),
                }
        out.append(message)
    if plan.describe and plan.tools:
        listing = "\n".join(json.dumps(t["function"]) for t in plan.tools)
        text = _SYSTEM_TOOLS.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # left as the client wrote it
    return {**call, "function": function}


def _hermes_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


def calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def parse_answer(plan: ToolPlan, text: str) -> ParsedOutput:
    """The answer's text and calls (no calls without a format). An enforced answer cut short
    (max_tokens) keeps the calls whose arguments are whole: the grammar made each of them well
    formed (`close_structure_on_length` makes the last one whole before the cut)."""
    if plan.fmt is None:
        return ParsedOutput(text, [])
    parsed = plan.fmt.parse(text)
    if plan.lenient and plan.tools and not parsed.calls:
        call = lenient_call(text, plan.tools)
        if call is not None:
            return ParsedOutput("", [call])
    start = plan.fmt.region_start(text)
    if parsed.calls or not plan.eager or start is None:
        return parsed
    region = plan.fmt.parse_region(text[start:])
    return ParsedOutput(text[:start].rstrip(), region.whole_calls)


def delta_calls_json(delta: StreamDelta) -> list[dict[str, Any]]:
    """A stream delta's call pieces as OpenAI's `delta.tool_calls`."""
    out = []
    for piece in delta.calls:
        entry: dict[str, Any] = {"index": piece.index}
        function: dict[str, Any] = {"arguments": piece.arguments}
        if piece.id is not None:
            entry.update(id=piece.id, type="function")
            function["name"] = piece.name
        entry["function"] = function
        out.append(entry)
    return out


def stream_parser(plan: ToolPlan) -> StreamingToolParser | None:
    """A streaming parser for one choice, None without a format."""
    if plan.fmt is None:
        return None
    return StreamingToolParser(plan.fmt, plan.eager, plan.tools if plan.lenient else None)


def special_markers(state: ServerState, plan: ToolPlan) -> bool:
    """Whether the format's markers are special tokens of this tokenizer (the detokenizer must
    keep special tokens for the parser to see them)."""
    if plan.fmt is None:
        return False
    special = set(state.tokenizer.all_special_ids)
    return any(state.tokenizer.token_to_id(m) in special for m in plan.fmt.markers)


def parse_function_call(
    state: ServerState, text: str, tools: list[dict[str, Any]], parser: str | None
) -> tuple[str, list[ToolCall]]:
    """SGLang's `/parse_function_call`: the text and calls of an output generated elsewhere
    (e.g. by `/generate`), in `parser`'s format (default: the server's)."""
    _check_tools(tools)
    fmt = get_format(parser) if parser else tool_format(state)[0]
    parsed = fmt.parse(text)
    names = {t["function"]["name"] for t in tools}
    unknown = [c.name for c in parsed.calls if c.name not in names]
    if unknown:  # a call of no given tool stays text, as a malformed one does
        return text, []
    return parsed.content, parsed.calls
