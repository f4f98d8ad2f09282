"""Constrained decoding through the HTTP APIs, on the real server and model.

Native `/generate` (`regex`, `json_schema` as a string or an object, `ebnf`), the OpenAI API
through the official client (`response_format` json_schema / json_object, the `regex` extra),
and the 400s for invalid or conflicting constraints (with the grammar parser's message, the
field in `param`, and the server still serving afterwards). Greedy, few tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_PROMPT = "Alice is 31 years old. Describe her as JSON with her name and age.\nJSON: "
YES_NO = r"(yes|no)"


@pytest.fixture(scope="module")
def url(sglite_server):
    return sglite_server.url


@pytest.fixture(scope="module")
def client(sglite_server):
    return openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def generate(url: str, text: str | list[str], **params) -> dict | list:
    body = {"text": text, "sampling_params": {"temperature": 0, **params}}
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_400(resp: requests.Response, needle: str, param: str | None) -> dict:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert needle.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serving(url: str) -> None:
    out = generate(url, "Is the sky blue? Answer:", max_new_tokens=4, regex=YES_NO)
    assert re.fullmatch(YES_NO, out["text"]), out


# ---------------------------------------------------------------------------- native
def test_native_regex_fullmatches(url):
    out = generate(url, "Is water wet? Answer yes or no:", max_new_tokens=6, regex=YES_NO)
    assert re.fullmatch(YES_NO, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    out = generate(url, "The first moon landing happened on (YYYY-MM-DD):", max_new_tokens=16,
                   regex=date)  # fmt: skip
    assert re.fullmatch(date, out["text"]), out["text"]


@pytest.mark.parametrize("as_string", [False, True], ids=["object", "string"])
def test_native_json_schema_validates(url, as_string):
    schema = json.dumps(PERSON_SCHEMA) if as_string else PERSON_SCHEMA
    out = generate(url, PERSON_PROMPT, max_new_tokens=40, json_schema=schema)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = json.loads(out["text"])
    jsonschema.validate(value, PERSON_SCHEMA)


def test_native_ebnf_and_batch_with_own_constraints(url):
    grammar = 'root ::= ("red" | "green" | "blue") " " ("car" | "bike")'
    out = generate(url, "A vehicle and its color:", max_new_tokens=6, ebnf=grammar)
    assert re.fullmatch(r"(red|green|blue) (car|bike)", out["text"]), out["text"]
    # A batch where each prompt has its own constraint (and one has none).
    body = {
        "text": ["Is fire hot? Answer:", "Count: 1, 2, 3,", "Count: 1, 2, 3,"],
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 4, "regex": YES_NO},
            {"temperature": 0, "max_new_tokens": 6, "regex": r" [0-9]+"},
            {"temperature": 0, "max_new_tokens": 3},
        ],
    }
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    a, b, c = r.json()
    assert re.fullmatch(YES_NO, a["text"]) and re.fullmatch(r" [0-9]+", b["text"]), (a, b)
    assert c["meta_info"]["completion_tokens"] == 3


def test_native_stream_regex(url):
    body = {
        "text": "Is the sun a star? Answer:",
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "regex": YES_NO},
        "stream": True,
    }
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    events = [e[len("data: ") :] for e in r.content.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert re.fullmatch(YES_NO, last["text"]), last


# ---------------------------------------------------------------------------- OpenAI
def test_chat_response_format_json_schema_strict(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PERSON_PROMPT}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_chat_response_format_json_object(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a JSON object describing a cat."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = r.choices[0].message.content
    assert content.startswith("{"), content
    if r.choices[0].finish_reason == "stop":  # a length cut leaves a prefix of an object
        assert isinstance(json.loads(content), dict)


def test_chat_parse_with_a_pydantic_model(client, model):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": PERSON_PROMPT}],
        max_tokens=40,
        temperature=0,
        response_format=Person,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person), r.choices[0].message.content


def test_completions_regex_extra_and_stream(client, model):
    r = client.completions.create(model=model, prompt="Is ice cold? Answer:", max_tokens=4,
                                  temperature=0, extra_body={"regex": YES_NO})  # fmt: skip
    assert re.fullmatch(YES_NO, r.choices[0].text), r.choices[0].text
    chunks = client.completions.create(model=model, prompt="Is ice cold? Answer:", max_tokens=4,
                                       temperature=0, stream=True,
                                       extra_body={"regex": YES_NO})  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_completions_json_schema_extra(client, model):
    extra = {"json_schema": json.dumps(PERSON_SCHEMA)}
    r = client.completions.create(
        model=model, prompt=PERSON_PROMPT, max_tokens=40, temperature=0, n=2, extra_body=extra
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), PERSON_SCHEMA)


# ---------------------------------------------------------------------------- errors
CHAT = [{"role": "user", "content": "Hi"}]
# (route, body, text the message must contain, expected param)
INVALID = [
    ("/generate", {"text": "Hi", "sampling_params": {"regex": "[unclosed"}},
     "unclosed character class", "sampling_params.regex"),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": "{not json"}},
     "json_schema", "sampling_params.json_schema"),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": {"type": "objec"}}},
     "objec", "sampling_params.json_schema"),
    ("/generate", {"text": "Hi", "sampling_params": {"ebnf": "root ::= ("}},
     "ebnf", "sampling_params.ebnf"),
    ("/generate", {"text": "Hi", "sampling_params": {"regex": "a", "json_schema": "{}"}},
     "json_schema", None),
    ("/v1/completions", {"prompt": "Hi", "regex": "(a"}, "regex", "regex"),
    ("/v1/completions", {"prompt": "Hi", "ebnf": "root ::= ("}, "ebnf", "ebnf"),
    ("/v1/completions", {"prompt": "Hi", "regex": "a", "ebnf": 'root ::= "a"'}, "regex", "ebnf"),
    ("/v1/chat/completions", {"messages": CHAT, "json_schema": {"type": 5}}, "json_schema",
     "json_schema"),
    ("/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "response_format.json_schema"),
    ("/v1/chat/completions",
     {"messages": CHAT,
      "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
     "objec", "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}},
     "response_format", "response_format.type"),
    ("/v1/chat/completions",
     {"messages": CHAT, "regex": "a", "response_format": {"type": "json_object"}},
     "regex", "response_format"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "needle", "param"), INVALID, ids=[f"{r}:{p}" for r, _, _, p in INVALID]
)
def test_invalid_constraints_are_400(url, route, body, needle, param):
    check_400(requests.post(url + route, json=body, timeout=60), needle, param)


def test_two_constraints_name_both(url):
    r = requests.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": CHAT, "regex": "a", "response_format": {"type": "json_object"},
    })  # fmt: skip
    message = check_400(r, "regex", "response_format")["message"]
    assert "response_format" in message
    r = requests.post(url + "/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'},
    })  # fmt: skip
    message = check_400(r, "regex", None)["message"]
    assert "ebnf" in message


def test_invalid_regex_message_is_the_parsers_and_server_keeps_serving(url, client, model):
    r = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {"regex": "(a"}},
                      timeout=60)  # fmt: skip
    err = check_400(r, "regex", "sampling_params.regex")
    assert "unclosed" in err["message"].lower() or "parse" in err["message"].lower(), err
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "objec"}}},
        )  # fmt: skip
    assert "objec" in str(exc.value)
    still_serving(url)
    info = requests.get(url + "/get_server_info", timeout=30).json()
    assert info["kv_invariants"]["ok"], info["kv_invariants"]
    assert info["grammar_backend"] == "llguidance"


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _generate_json(url: str, budget: int, close: bool) -> tuple[str, dict]:
    params = {"max_new_tokens": budget, "temperature": 0, "json_schema": json.dumps(PERSON)}
    if close:
        params["close_structure_on_length"] = True
    body = {"text": "Describe a person as JSON:", "sampling_params": params}
    out = requests.post(url + "/generate", json=body, timeout=60).json()
    return out["text"], out["meta_info"]["finish_reason"]


def test_a_cut_json_answer_closes_its_structure_when_asked(url):
    """max_new_tokens cuts the model's JSON mid-value; with close_structure_on_length the
    answer still parses and validates, and says it was cut (finish reason length)."""
    cut, reason = _generate_json(url, 12, close=False)
    assert reason["type"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)
    for budget in (12, 13, 14, 15):
        text, reason = _generate_json(url, budget, close=True)
        jsonschema.validate(json.loads(text), PERSON)
        assert reason["type"] == "length", (budget, reason, text)
