"""The OpenAI-compatible API (`/v1`) driven by the official `openai` client."""

from __future__ import annotations

import openai
import pytest
import requests

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG_SYSTEM = (
    "You are a meticulous assistant for a geography quiz. Always answer with the name of a city "
    "and nothing else. Be precise, be brief, and never add commentary or explanations. "
)


@pytest.fixture(scope="module")
def client(sglite_server):
    return openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def native(server, **body):
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_matches_native(client, model, sglite_server):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    ref = native(
        sglite_server, text=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert choice.text == ref["text"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream(client, model):
    kw = dict(model=model, prompt="List three colors:", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completion_prompt_forms(client, model, sglite_server):
    texts = ["Red, green,", "One, two,"]
    by_text = client.completions.create(model=model, prompt=texts, max_tokens=4, temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1]
    ids = requests.post(sglite_server.url + "/tokenize", json={"prompt": texts}, timeout=30)
    ids = ids.json()["tokens"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    one = client.completions.create(model=model, prompt=ids[0], max_tokens=4, temperature=0)
    assert one.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_completion_echo_and_logprobs(client, model):
    prompt = "The sky is"
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert "".join(lp.tokens) == choice.text
    for top, token, value in zip(
        lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:], strict=True
    ):
        assert token in top and top[token] == pytest.approx(value)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=0)  # fmt: skip
    assert len(plain.choices[0].logprobs.tokens) == plain.usage.completion_tokens


def test_completion_stream_echo_logprobs(client, model):
    kw = dict(model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert tokens == whole.logprobs.tokens
    values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])


def test_completion_n_and_seed(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7)
    r = client.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    again = client.completions.create(n=2, **kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded


def test_completion_stop(client, model):
    r = client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[","]
    )
    choice = r.choices[0]
    assert "," not in choice.text and choice.finish_reason == "stop"
    assert choice.model_extra.get("matched_stop") == ","


def test_completion_stream_usage_and_n(client, model):
    chunks = list(
        client.completions.create(
            model=model, prompt=["A, B,", "1, 2,"], n=2, max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0


def test_chat(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert "Paris" in msg.content
    chunks = list(
        client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_logprobs_n_stop(client, model):
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, n=2, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens // 2
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
    stopped = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=32, temperature=0, stop=["Paris"]
    )
    assert "Paris" not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_stream_include_usage(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, logprobs=True,
        )
    )  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    n_logprobs = sum(len(c.choices[0].logprobs.content) for c in chunks[:-1]
                     if c.choices and c.choices[0].logprobs)  # fmt: skip
    assert n_logprobs == usage.completion_tokens


def test_usage_reports_cached_tokens(client, model):
    messages = [
        {"role": "system", "content": LONG_SYSTEM + "(cache test 9137)"},
        {"role": "user", "content": "Capital of Italy?"},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=0)  # fmt: skip
    messages[1]["content"] = "Capital of Spain?"
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                            temperature=0)  # fmt: skip
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached >= 30  # the whole shared system prompt


def test_extra_sampling_fields(client, model):
    r = client.completions.create(
        model=model, prompt="Hello", max_tokens=5, temperature=0.7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )  # fmt: skip
    assert r.usage.completion_tokens == 5  # ignore_eos
    r = client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0,
                                  extra_body={"regex": "[0-9]+"})  # fmt: skip
    assert r.choices[0].text.isdigit()  # constraints: tests/test_constrained_api.py
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=2,
                                  extra_body={"regex": "[0-9"})  # fmt: skip
    assert "regex" in str(err.value)
