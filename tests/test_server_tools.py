"""Tool calls through the chat API on the real server and the default model (whose template renders
no tools: they go into a system message in the Hermes format), driven by the `openai` client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(sglite_server):
    return openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_required_calls_always_parse_and_validate(client, model):
    for prompt in ("What is the weather in Paris?", "Hello!", "Write a poem about the sea."):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)


def test_named_choice_calls_that_function(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0.8,
        seed=3,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _valid("get_time", call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"


def test_auto_parses_a_call_out_of_the_answer(client, model):
    """auto: whatever the model writes in the call format comes back as tool_calls (here the
    answer is forced into that format with a regex, as a tool-happy model would write it)."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
    call += r'"unit": "celsius"\}\}\n</tool_call>'
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        extra_body={"regex": call},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (parsed,) = choice.message.tool_calls
    assert parsed.function.name == "get_weather"
    assert _valid("get_weather", parsed.function.arguments)["unit"] == "celsius"
    plain = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None  # text stays text
    assert plain.choices[0].message.content


def test_streamed_calls_assemble_from_deltas(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    content, reasons, pieces = "", [], 0
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reasons.append(choice.finish_reason)
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": None, "arguments": "", "id": None})
            if d.id:
                assert entry["id"] is None and d.function.name  # id and name come first
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
            pieces += 1
    assert content == "" and calls
    for entry in calls.values():
        _valid(entry["name"], entry["arguments"])
    assert pieces > len(calls)  # arguments arrived in pieces
    reference = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    first = reference.choices[0].message.tool_calls[0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        first.function.name,
        first.function.arguments,
    )
    assert reasons[-1] == "tool_calls"


def test_tool_round_trip_reuses_the_cached_prefix(client, model):
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=20, temperature=0
    )
    assert second.choices[0].message.content
    # The system message with the tools and the question are cached from the first turn.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8


def test_parse_with_a_pydantic_model(client, model):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name a city in France."}],
        response_format=City,
        max_tokens=60,
        temperature=0,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"n": 2}, "n"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "bad", "parameters": {"type": "no-such-type"}},
                    }
                ],
            },
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_answer_400_naming_the_field(sglite_server, model, body, field):
    request = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 8, **body}
    r = requests.post(sglite_server.url + "/v1/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


THINKING = r"<think>\nThe user wants a greeting\.\n</think>\n\nHello [a-z]{3,6}!"


@pytest.fixture(scope="module")
def thinking_client():
    """A server with `--reasoning-parser qwen3` (its answers are forced into a think block
    with a regex: the default model does not think by itself) and `--strict-model-name`."""
    from server_fixtures import ServerProcess

    server = ServerProcess("--reasoning-parser", "qwen3", "--strict-model-name")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield client, client.models.list().data[0].id
    server.stop()


def test_reasoning_is_separated_whole_and_streamed(thinking_client):
    client, model = thinking_client
    ask = {"model": model, "messages": ASK, "max_tokens": 40, "temperature": 0}
    r = client.chat.completions.create(**ask, extra_body={"regex": THINKING})
    message = r.choices[0].message
    assert message.reasoning_content == "The user wants a greeting.\n"
    assert message.content.startswith("Hello ") and "<think>" not in message.content
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True, extra_body={"regex": THINKING}):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    raw = client.chat.completions.create(
        **ask, extra_body={"regex": THINKING, "separate_reasoning": False}
    )
    assert raw.choices[0].message.content.startswith("<think>")
    assert getattr(raw.choices[0].message, "reasoning_content", None) is None


def test_any_model_name_is_served_unless_strict(client, model, thinking_client):
    """Clients send the name they were configured with (SGLang's bench_serving sends its
    tokenizer path, apps send `default`): one model serves them all, and /v1/models lists its
    real name; `--strict-model-name` answers other names with OpenAI's 404."""
    for name in ("default", "Qwen/Qwen3-8B", model):
        r = client.chat.completions.create(model=name, messages=ASK, max_tokens=2)
        assert r.choices[0].message.content is not None and r.model == name
    assert [m.id for m in client.models.list().data] == [model]
    strict, strict_model = thinking_client
    with pytest.raises(openai.NotFoundError) as err:
        strict.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    for name in (strict_model, "default"):  # its name and the server's aliases
        assert strict.chat.completions.create(model=name, messages=ASK, max_tokens=2)


def test_native_parse_function_call(sglite_server):
    """SGLang's /parse_function_call splits text generated with /generate (here, forced into a
    call with the Hermes grammar the chat route enforces) into text and calls."""
    from sglite.runtime.tool_calls.formats import get_format

    url = sglite_server.url
    grammar = get_format("hermes").grammar(TOOLS, False, allow_text=False)
    out = requests.post(
        url + "/generate",
        json={
            "text": "Weather in Rome, please.",
            "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ebnf": grammar},
        },
        timeout=120,
    ).json()
    body = {"text": "Sure. " + out["text"], "tools": TOOLS, "tool_call_parser": "qwen25"}
    parsed = requests.post(url + "/parse_function_call", json=body, timeout=30).json()
    assert parsed["normal_text"] == "Sure."
    (call,) = parsed["calls"]
    assert call["tool_index"] == [t["function"]["name"] for t in TOOLS].index(call["name"])
    _valid(call["name"], call["parameters"])
    plain = {"text": "No calls here.", "tools": TOOLS}
    assert requests.post(url + "/parse_function_call", json=plain, timeout=30).json() == {
        "normal_text": "No calls here.",
        "calls": [],
    }
    bad = requests.post(url + "/parse_function_call", json={**body, "tool_call_parser": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_call_parser"


PERSON_TOOL = {
    "type": "function",
    "function": {
        "name": "save_person",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "city": {"type": "string"},
            },
            "required": ["name", "age", "city"],
            "additionalProperties": False,
        },
    },
}


def test_a_call_cut_by_max_tokens_is_closed_when_asked(client, model):
    """A forced call that max_tokens cuts before its end has no call (its arguments do not
    parse); with close_structure_on_length the call comes back whole, its arguments valid
    under the schema, and finish_reason stays length."""
    ask = [{"role": "user", "content": "Save the person Alice Wonderland, 42, from Paris."}]
    choice = {"type": "function", "function": {"name": "save_person"}}
    request = dict(
        model=model, messages=ask, tools=[PERSON_TOOL], tool_choice=choice, max_tokens=36,
        temperature=0,
    )  # fmt: skip
    cut = client.chat.completions.create(**request).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
    closed = client.chat.completions.create(
        **request, extra_body={"close_structure_on_length": True}
    ).choices[0]
    assert closed.finish_reason == "length"
    (call,) = closed.message.tool_calls
    assert call.function.name == "save_person"
    jsonschema.validate(json.loads(call.function.arguments), PERSON_TOOL["function"]["parameters"])
