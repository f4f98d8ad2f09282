"""The Responses API (`/v1/responses`) on the real server and the default model, driven by the
`openai` client: text and message input, instructions, function tools, streaming events, and
conversations continued with `previous_response_id` from the cached prefix."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(sglite_server):
    return openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)


def test_text_input_with_instructions(client, sglite_server):
    r = client.responses.create(
        model="default",
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    chat = requests.post(
        sglite_server.url + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            "max_tokens": 24,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    assert r.output_text == chat["choices"][0]["message"]["content"]  # the same conversation
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_previous_response_id_continues_from_the_cached_prefix(client):
    first = client.responses.create(
        model="default",
        instructions="You are a terse assistant.",
        input="Name a primary color.",
        max_output_tokens=16,
        temperature=0,
    )
    second = client.responses.create(
        model="default",
        instructions="You are a terse assistant.",
        previous_response_id=first.id,
        input=[{"role": "user", "content": "Name another one."}],
        max_output_tokens=16,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text
    # The first turn (instructions, question, answer) is the cached prefix of the second.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="default", previous_response_id="resp_nope", input="x")
    assert err.value.body["param"] == "previous_response_id"


def test_function_tools_and_their_outputs(client):
    r = client.responses.create(
        model="default",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model="default",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"c": 21}'}],
        tools=[WEATHER],
        max_output_tokens=16,
        temperature=0,
    )
    assert follow.output_text
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_streaming_events(client):
    events = list(
        client.responses.create(
            model="default",
            input="Say hello.",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text
    for name in ("response.output_item.added", "response.output_text.done",
                 "response.output_item.done"):  # fmt: skip
        assert name in kinds
    called = list(
        client.responses.create(
            model="default",
            input="Weather in Oslo?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    arguments = "".join(
        e.delta for e in called if e.type == "response.function_call_arguments.delta"
    )
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    (item,) = [i for i in called[-1].response.output if i.type == "function_call"]
    assert item.arguments == arguments


def test_bad_responses_requests_answer_400(sglite_server):
    url = sglite_server.url + "/v1/responses"
    for body, field in [
        ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ]:
        r = requests.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert field in (r.json()["error"]["param"] or ""), r.json()
