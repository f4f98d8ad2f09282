"""Bad input answers 400 with an OpenAI-shaped error naming the field; never 500, never a hang."""

from __future__ import annotations

import pytest
import requests

LONG = "hello " * 9000  # more tokens than the 8192-token context
CHAT = [{"role": "user", "content": "Hi"}]

# (route, body, text the message must contain)
BAD = [
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "Hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": -5}}, "top_k"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"n": 65}}, "n"),
    ("/generate", {"text": "Hi", "sampling_params": {"n": 0}}, "n"),
    ("/generate", {"text": "Hi", "sampling_params": {"stop": 5}}, "stop"),
    ("/generate", {"text": "Hi", "sampling_params": {"stop_regex": "("}}, "stop_regex"),
    ("/generate", {"text": "Hi", "sampling_params": {"bogus": 1}}, "bogus"),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}},
        "min_new_tokens",
    ),  # fmt: skip
    ("/generate", {"text": "Hi", "sampling_params": {"regex": "[a-z"}}, "regex"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 10**6}}, "context length"),
    ("/generate", {"text": LONG}, "context length"),
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": []}, "empty"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "Hi \ud800"}, "surrogate"),
    ("/v1/completions", {"prompt": "Hi \ud800"}, "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "surrogate"),
    ("/tokenize", {"prompt": "\ud800"}, "surrogate"),
    ("/generate", {}, "input_ids"),
    ("/generate", {"text": "Hi", "input_ids": [1, 2]}, "input_ids"),
    ("/generate", {"input_ids": [1, 10**9]}, "input_ids"),
    ("/generate", {"input_ids": ["a"]}, "input_ids"),
    ("/generate", {"text": "Hi", "return_logprob": "yes"}, "return_logprob"),
    (
        "/generate",
        {"text": "Hi", "top_logprobs_num": 50, "return_logprob": True},
        "top_logprobs_num",
    ),  # fmt: skip
    ("/generate", {"text": "Hi", "logprob_start_len": -7}, "logprob_start_len"),
    ("/generate", {"text": "Hi", "image_data": "abc"}, "image_data"),
    ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": "x"}, "rid"),  # one id for a batch
    ("/encode", {"text": ["a", "b"], "rid": "x"}, "rid"),  # the fuzzer's hang: answered by id
    ("/v1/completions", {"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "n": 100}, "n"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, "context length"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], 3]}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "regex": "(a"}, "regex"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": CHAT, "extra_body": 1, "ebnf": "root ::= ("}, "ebnf"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "context length"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "content",
    ),  # fmt: skip
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/concate_and_append_request", {"src_rids": "a"}, "src_rids"),
]


@pytest.fixture(scope="module")
def url(sglite_server):
    return sglite_server.url


def check_error(resp: requests.Response, status: int, needle: str) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert needle.lower() in err["message"].lower(), err
    # Errors name the problem; they never leak a stack trace or source paths.
    assert "Traceback" not in resp.text and 'File "' not in resp.text, resp.text
    return err


@pytest.mark.parametrize(("route", "body", "needle"), BAD, ids=[f"{r}:{n}" for r, _, n in BAD])
def test_bad_input_is_400(url, route, body, needle):
    err = check_error(requests.post(url + route, json=body, timeout=60), 400, needle)
    assert err["type"] == "invalid_request_error"


def test_field_named_in_param(url):
    r = requests.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=30)
    assert check_error(r, 400, "temperature")["param"] == "temperature"
    r = requests.post(
        url + "/generate", json={"text": "x", "sampling_params": {"top_p": 5}}, timeout=30
    )
    assert check_error(r, 400, "top_p")["param"] == "sampling_params.top_p"


def test_prompt_past_the_context_is_known_by_its_code(url):
    """OpenAI clients tell a too-long prompt from other 400s by `context_length_exceeded`; a
    different 400 has no such code."""
    info = requests.get(url + "/get_model_info", timeout=30).json()
    ids = [1] * (info["context_length"] + 1)
    for route, body in (
        ("/v1/completions", {"prompt": ids, "max_tokens": 1}),
        ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}),
    ):
        err = check_error(requests.post(url + route, json=body, timeout=60), 400, "context")
        assert err["code"] == "context_length_exceeded", (route, err)
    r = requests.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=30)
    assert check_error(r, 400, "temperature")["code"] is None


@pytest.mark.parametrize(
    "raw", [b"{", b"not json", b"[1, 2]", b"", b'{"text": "Hi", }', b"\xff\xfe"]
)
def test_malformed_json_is_400(url, raw):
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        resp = requests.post(
            url + route, data=raw, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert resp.status_code == 400, (route, raw, resp.text)
        assert "error" in resp.json()


def test_body_without_content_type_is_read_as_json(url):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded.
    resp = requests.post(
        url + "/generate",
        data=b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2}}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def test_stream_with_bad_input_is_400_before_streaming(url):
    body = {"text": "Hi", "stream": True, "sampling_params": {"temperature": -1}}
    check_error(requests.post(url + "/generate", json=body, timeout=30), 400, "temperature")
    body = {"prompt": "Hi", "stream": True, "max_tokens": -2}
    check_error(requests.post(url + "/v1/completions", json=body, timeout=30), 400, "max_tokens")


def test_unknown_route_and_method(url):
    check_error(requests.get(url + "/no/such/route", timeout=10), 404, "no route")
    check_error(requests.post(url + "/v1/no-such", json={}, timeout=10), 404, "no route")
    check_error(requests.delete(url + "/generate", timeout=10), 405, "not allowed")


def test_server_still_answers_after_bad_input(url):
    for route, body, _ in BAD[:10]:
        requests.post(url + route, json=body, timeout=60)
    assert requests.get(url + "/health_generate", timeout=60).status_code == 200
    r = requests.post(
        url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2
    info = requests.get(url + "/get_server_info", timeout=30).json()
    assert info["kv_invariants"]["ok"] and info["num_in_flight_reqs"] == 0
