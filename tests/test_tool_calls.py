"""Tool-call parsing on recorded model outputs, whole and streamed at every split, for each
format; malformed calls stay text; the enforcing grammars compile and accept their format."""

from __future__ import annotations

import json

import pytest

from sglite.runtime.tool_calls.base import StreamingToolParser
from sglite.runtime.tool_calls.formats import FORMATS, detect_format, get_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# format -> (output, expected content, expected [(name, arguments)])
RECORDED = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    "llama3": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {})],
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome \\"IT\\""}}]',
        "",
        [("get_weather", {"city": 'Rome "IT"'})],
    ),
    "pythonic": (
        '[get_weather(city="Lima", unit="f"), get_time()]',
        "",
        [("get_weather", {"city": "Lima", "unit": "f"}), ("get_time", {})],
    ),
}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", list(RECORDED))
def test_whole_outputs_parse_into_content_and_calls(name):
    text, content, calls = RECORDED[name]
    parsed = get_format(name).parse(text)
    assert parsed.content == content
    assert _calls(parsed.calls) == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("name", list(RECORDED))
@pytest.mark.parametrize("eager", [False, True])
def test_streams_split_anywhere_give_the_same_calls_and_no_call_text(name, eager):
    text, content, calls = RECORDED[name]
    fmt = get_format(name)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text], [text[: cut // 2], text[:cut], text]):
            parser = StreamingToolParser(fmt, eager)
            got_content, got = "", {}
            deltas = [parser.update(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]
            for delta in deltas:
                got_content += delta.content
                for d in delta.calls:
                    call = got.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                    if d.id is not None:
                        assert call["id"] is None and d.name is not None  # id and name first
                        call["id"], call["name"] = d.id, d.name
                    call["arguments"] += d.arguments
            assert got_content.strip() == content, (cut, got_content)
            assert [(c["name"], json.loads(c["arguments"])) for c in got.values()] == calls


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),
        ("llama3", '{"name": "get_weather", "parameters": '),
        ("mistral", "[TOOL_CALLS] oops"),
        ("pythonic", "[get_weather(city=Paris)]"),
    ],
)
def test_malformed_calls_come_back_as_text(name, text):
    fmt = get_format(name)
    parsed = fmt.parse(text)
    assert parsed.content == text and parsed.calls == []
    parser = StreamingToolParser(fmt)
    first = parser.update(text[: len(text) // 2])
    finish = parser.finish(text)
    assert finish.calls == [] and parser.calls == []
    assert first.content + finish.content == text


def test_plain_text_streams_through_and_marker_prefixes_wait():
    parser = StreamingToolParser(get_format("hermes"))
    assert parser.update("The answer is 4 <tool").content == "The answer is 4 "
    assert parser.update("The answer is 4 <tools are not needed").content == "<tools are not needed"
    assert parser.finish("The answer is 4 <tools are not needed.").content == "."


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("allow_text", [False, True])
def test_enforcing_grammars_compile(name, parallel, allow_text):
    import llguidance

    text = get_format(name).grammar([WEATHER, TIME], parallel, allow_text)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert not is_error, messages


def test_formats_are_detected_from_chat_templates():
    assert detect_format("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}").name == (
        "hermes"
    )
    assert detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_format("{{- '<|python_tag|>' }}").name == "llama3"
    assert detect_format("[func_name1(params_name1=params_value1)]").name == "pythonic"
    assert detect_format("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_format("nope")


def test_function_tools_from_python_signatures():
    import llguidance

    import sglite as sgl
    from sglite.lang.tools import parse_tool_calls, tool_grammar

    def search(query: str, limit: int = 5, tags: list[str] | None = None) -> list:
        """Search the notes.

        Longer details that stay out of the description."""
        return []

    tool = sgl.function_tool(search)["function"]
    assert tool["name"] == "search" and tool["description"] == "Search the notes."
    assert tool["parameters"]["required"] == ["query"]
    assert tool["parameters"]["properties"]["limit"] == {"type": "integer"}
    for choice in ("required", "auto", "search"):
        grammar = llguidance.LLMatcher.grammar_from_lark(tool_grammar([search], choice, False))
        assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]
    with pytest.raises(ValueError, match="names none of the tools"):
        tool_grammar([search], "nope", False)
    calls = parse_tool_calls(
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    )
    assert [(c["name"], c["arguments"]) for c in calls] == [("search", {"query": "x"})]
    assert (
        sgl.call_tool([lambda query: query], {"name": "<lambda>", "arguments": {"query": 3}}) == 3
    )


LENIENT_CALLS = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '\n```\n{\n  "name": "get_weather",\n  "parameters": {"city": "Paris"}\n}\n```\n',
]
NOT_CALLS = [
    'Here: {"name": "get_weather", "arguments": {"city": "Paris"}}',  # text around it
    '{"name": "get_weather", "arguments": {"city": 3}}',  # arguments break the schema
    '{"name": "get_weather", "arguments": {}}',  # a required argument missing
    '{"name": "book_flight", "arguments": {"city": "Paris"}}',  # no such tool
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 1}',  # another key
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time"}',  # two
    '```python\nprint({"name": "get_weather", "arguments": {"city": "Paris"}})\n```',
]


@pytest.mark.parametrize("text", LENIENT_CALLS)
def test_lenient_auto_takes_one_plain_call_object(text):
    from sglite.runtime.tool_calls.lenient import lenient_call

    call = lenient_call(text, [WEATHER, TIME])
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    # Streamed: held back while it may be a call, then sent as the call at the end.
    parser = StreamingToolParser(get_format("hermes"), lenient_tools=[WEATHER, TIME])
    for end in range(1, len(text)):
        assert parser.update(text[:end]).content == ""
    last = parser.finish(text)
    assert last.content == "" and [(c.name, c.arguments) for c in last.calls] == [
        ("get_weather", call.arguments)
    ]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_lenient_auto_leaves_anything_else_as_text(text):
    from sglite.runtime.tool_calls.lenient import lenient_call

    assert lenient_call(text, [WEATHER, TIME]) is None
    parser = StreamingToolParser(get_format("hermes"), lenient_tools=[WEATHER, TIME])
    content = "".join(parser.update(text[:end]).content for end in range(1, len(text)))
    last = parser.finish(text)
    assert content + last.content == text and not last.calls


def test_code_answers_stream_at_once_with_lenient_auto():
    """A fenced block in another language cannot be a call: it is not held back."""
    parser = StreamingToolParser(get_format("hermes"), lenient_tools=[WEATHER])
    assert parser.update("```python\ndef f").content == "```python\ndef f"


def test_literals_spelling_special_tokens_name_the_tokens():
    """An enforcing grammar writes markers as text; where the vocabulary holds a marker as a
    special token, the engine names the token (llguidance never matches it through a
    literal's bytes), inside mixed literals too, and leaves `%json` schemas alone."""
    import llguidance

    from sglite.runtime.constrained.llguidance_backend import name_special_tokens

    special = {"<tool_call>": 7, "</tool_call>": 8}
    tool = {**WEATHER, "function": {**WEATHER["function"], "description": "<tool_call>"}}
    grammar = name_special_tokens(get_format("hermes").grammar([tool], True, False), special)
    assert "(<[7]>)" in grammar and "(<[8]>)" in grammar and '"<tool_call>"' not in grammar
    assert name_special_tokens('start: "a<tool_call>\\n"', special) == 'start: ("a" <[7]> "\\n")'
    schema = name_special_tokens('start: %json {"const": "<tool_call>"}', special)
    assert schema == 'start: %json {"const": "<tool_call>"}'
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    assert not is_error, messages
