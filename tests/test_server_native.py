"""The native (SGLang-compatible) HTTP API against the real server, over plain HTTP."""

from __future__ import annotations

import json

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

GREEDY = {"max_new_tokens": 12, "temperature": 0}
PREFIX = (
    "You are a helpful assistant that answers geography questions briefly. "
    "Question: which city is the capital of France? Answer:"
)


@pytest.fixture(scope="module")
def url(sglite_server):
    return sglite_server.url


def post(url: str, path: str, body: dict | list | None = None, **kw) -> requests.Response:
    return requests.post(url + path, json=body, timeout=120, **kw)


def generate(url: str, **body) -> dict | list:
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(resp: requests.Response) -> list[str]:
    """The `data:` payloads of an event stream, in order (checks the framing as it goes)."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.content.decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payloads.append(event[len("data: ") :])
    return payloads


# ---------------------------------------------------------------------------- health and info
def test_health_routes(url):
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/health_generate", timeout=60).status_code == 200


def test_model_info(url):
    info = requests.get(url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is True
    assert info["model_path"].endswith(".gguf") and "SmolLM2" in info["model_path"]
    assert "tokenizer_path" in info
    assert info["context_length"] > 0 and info["vocab_size"] == 49152
    assert requests.get(url + "/model_info", timeout=10).json() == info


def test_server_info(url):
    info = requests.get(url + "/get_server_info", timeout=30).json()
    keys = ["num_running_reqs", "num_queued_reqs", "cache_hit_rate", "pool_usage", "version",
            "max_total_num_tokens", "model_path", "max_running_requests"]  # fmt: skip
    for key in keys:
        assert key in info, key
    assert info["max_total_tokens"] == 8192
    assert "api_key" not in info
    assert info["kv_invariants"]["ok"] is True
    assert info["internal_states"][0]["num_running_reqs"] == info["num_running_reqs"]
    alias = requests.get(url + "/server_info", timeout=30).json()
    assert alias.keys() == info.keys()


# ---------------------------------------------------------------------------- /generate
def test_generate_single(url):
    out = generate(url, text="The capital of France is", sampling_params=GREEDY)
    assert isinstance(out, dict)
    assert isinstance(out["text"], str) and out["text"]
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "e2e_latency"):  # fmt: skip
        assert key in meta
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 12
    again = generate(url, text="The capital of France is", sampling_params=GREEDY)
    assert again["text"] == out["text"]  # greedy is deterministic


def test_generate_batch_and_input_ids(url):
    prompts = ["One, two, three,", "A, B, C,"]
    outs = generate(url, text=prompts, sampling_params=GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    ids = post(url, "/tokenize", {"prompt": prompts}).json()["tokens"]
    by_ids = generate(url, input_ids=ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in outs]
    one = generate(url, input_ids=ids[0], sampling_params=GREEDY)
    assert isinstance(one, dict) and one["text"] == outs[0]["text"]
    per_prompt = generate(
        url, text=prompts, sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 3}]
    )
    assert [o["meta_info"]["completion_tokens"] for o in per_prompt] == [2, 3]


def test_generate_accepts_nulls_like_sglang_client(url):
    # What sglang.RuntimeEndpoint sends: defaults written out literally, nulls and empty lists.
    body = {
        "text": "Hello",
        "sampling_params": {
            "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "max_new_tokens": 4, "min_new_tokens": None, "n": None, "stop": [],
            "stop_token_ids": [], "stop_regex": None, "temperature": 0, "top_p": None,
            "top_k": None, "min_p": None, "frequency_penalty": None, "presence_penalty": None,
            "repetition_penalty": None, "ignore_eos": None, "regex": None, "json_schema": None,
            "ebnf": None, "seed": None, "no_stop_trim": None,
        },
        "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
        "return_text_in_logprobs": None, "stream": None, "rid": None, "image_data": None,
        "lora_path": None,
    }  # fmt: skip
    out = generate(url, **body)
    assert out["meta_info"]["completion_tokens"] <= 4


def test_n_samples_and_rid(url):
    outs = generate(
        url, text="Once upon a time", rid="my-rid",
        sampling_params={"n": 3, "temperature": 1.0, "max_new_tokens": 4, "seed": 1},
    )  # fmt: skip
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["my-rid-0", "my-rid-1", "my-rid-2"]


def test_prefill_only_fills_cache(url):
    prompt = PREFIX + " (a prefill-only marker 5521)"
    out = generate(url, text=prompt, sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    again = generate(url, text=prompt + " Paris", sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 1


def test_logprobs_shapes(url):
    out = generate(
        url, text="The sky is", sampling_params={"max_new_tokens": 3, "temperature": 0},
        return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
        return_text_in_logprobs=True,
    )  # fmt: skip
    meta = out["meta_info"]
    n_prompt = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_prompt
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    for logprob, tid, text in meta["output_token_logprobs"]:
        assert logprob <= 0 and isinstance(tid, int) and isinstance(text, str)
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert chosen[1] == top[0][1]
    no_text = generate(
        url, text="The sky is", sampling_params={"max_new_tokens": 1},
        return_logprob=True,
    )  # fmt: skip
    assert no_text["meta_info"]["output_token_logprobs"][0][2] is None


def test_select_style_logprob_requests(url):
    """Exactly what SGLang's select() sends (protocol.md, "How select uses it")."""
    prefix = "The capital of France is"
    choices = [" Paris", " a banana split", " Berlin"]
    first = generate(url, text=prefix, sampling_params={"max_new_tokens": 0})
    prompt_len = first["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 2, 0)
    outs = generate(
        url, text=[prefix + c for c in choices],
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True, return_text_in_logprobs=True, logprob_start_len=start,
    )  # fmt: skip
    assert isinstance(outs, list) and len(outs) == len(choices)
    means = []
    for out in outs:
        meta = out["meta_info"]
        lps = meta["input_token_logprobs"]
        assert len(lps) == meta["prompt_tokens"] - start
        assert meta["output_token_logprobs"] == []
        assert isinstance(lps[0][2], str)  # the client checks the healed token's text
        values = [x[0] for x in lps if x[0] is not None]
        assert values
        means.append(sum(values) / len(values))
    assert means.index(max(means)) == 0, means
    # The same logprobs as computed from position 0 (cache hits must not change them).
    full = generate(
        url, text=prefix + choices[0], sampling_params={"max_new_tokens": 0},
        return_logprob=True, logprob_start_len=0,
    )  # fmt: skip
    tail = full["meta_info"]["input_token_logprobs"][start + 1 :]
    for (a, ta, _), (b, tb, _) in zip(
        tail, outs[0]["meta_info"]["input_token_logprobs"][1:], strict=True
    ):
        assert ta == tb and a == pytest.approx(b, abs=1e-3)


def test_stream_events(url):
    body = {
        "text": "Count: one, two, three,", "stream": True, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }  # fmt: skip
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        payloads = sse_events(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before)  # cumulative text
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] is not None
    # Incremental logprobs: each event carries only its new tokens.
    total = sum(len(c["meta_info"]["output_token_logprobs"]) for c in chunks)
    assert total == final["meta_info"]["completion_tokens"]
    # ...and how many the stream has carried so far, as SGLang 0.5 sends it.
    carried = 0
    for c in chunks:
        carried += len(c["meta_info"]["output_token_logprobs"])
        assert c["meta_info"]["output_token_logprobs_length"] == carried
        assert c["meta_info"]["completion_tokens"] == carried
    body.pop("stream")
    whole = generate(url, **body)
    assert final["text"] == whole["text"]
    assert final["output_ids"] == whole["output_ids"]


def test_stream_batch_tags_index(url):
    body = {
        "text": ["Red, green,", "Monday, Tuesday,"],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": True,
    }  # fmt: skip
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        chunks = [json.loads(p) for p in sse_events(r)[:-1]]
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    ref = generate(url, text=body["text"], sampling_params=body["sampling_params"])
    assert [finals[i]["text"] for i in (0, 1)] == [o["text"] for o in ref]


# ---------------------------------------------------------------------------- other routes
def test_flush_cache(url):
    r = post(url, "/flush_cache", {"empty_cache": True})  # what sglang's client sends
    assert r.status_code == 200, r.text
    assert requests.post(url + "/flush_cache", timeout=30).status_code == 200
    assert requests.get(url + "/flush_cache", timeout=30).status_code == 200
    info = requests.get(url + "/get_server_info", timeout=30).json()
    assert info["cache_size_tokens"] == 0


def test_concate_and_append_request(url):
    r = post(url, "/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "c"})
    assert r.status_code == 200 and r.json()["success"] is True


def test_tokenize_detokenize(url):
    text = "Hello, world! Héllo."
    tok = post(url, "/tokenize", {"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert post(url, "/v1/tokenize", {"prompt": text}).json() == tok
    detok = post(url, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert detok["text"] == text
    batch = post(url, "/detokenize", {"tokens": [tok["tokens"], tok["tokens"][:2]]}).json()
    assert batch["text"][0] == text and len(batch["text"]) == 2
    assert post(url, "/v1/detokenize", {"tokens": tok["tokens"]}).json() == detok
    bad = post(url, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


def test_metrics(url):
    generate(url, text=PREFIX, sampling_params=GREEDY)
    generate(url, text=PREFIX, sampling_params=GREEDY)  # a cache hit
    with requests.post(
        url + "/generate", stream=True, timeout=60,
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}, "stream": True},
    ) as r:  # fmt: skip
        sse_events(r)
    r = requests.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, 0.0)
            samples[s.name] += s.value
    assert samples["sglite:num_requests_total"] >= 3
    assert samples["sglite:prompt_tokens_total"] > 0
    assert samples["sglite:generation_tokens_total"] > 0
    assert samples["sglite:cached_tokens_total"] > 0
    assert 0 < samples["sglite:cache_hit_rate"] <= 1
    assert samples["sglite:num_queue_reqs"] == 0
    assert 0 <= samples["sglite:token_usage"] <= 1
    assert samples["sglite:time_to_first_token_seconds_count"] >= 3
    assert samples["sglite:inter_token_latency_seconds_count"] > 0
    assert samples["sglite:e2e_request_latency_seconds_count"] >= 3
    assert samples["sglite:http_requests_total"] > 0


def test_openapi_schema_lists_every_route(url):
    schema = requests.get(url + "/openapi.json", timeout=10).json()
    paths = set(schema["paths"])
    for path in ("/generate", "/health", "/health_generate", "/get_model_info",
                 "/get_server_info", "/flush_cache", "/concate_and_append_request", "/encode",
                 "/tokenize", "/detokenize", "/metrics", "/v1/models", "/v1/models/{model}",
                 "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                 "/v1/rerank"):  # fmt: skip
        assert path in paths, path
    components = schema["components"]["schemas"]
    for name in ("GenerateRequestIn", "SamplingParamsIn", "CompletionRequest",
                 "ChatCompletionRequest", "CompletionResponse", "ChatCompletionResponse",
                 "ErrorResponse"):  # fmt: skip
        assert name in components, name
