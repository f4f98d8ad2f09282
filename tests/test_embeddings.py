"""Embeddings (`Engine.encode`, `/v1/embeddings`, `/encode`) against transformers' hidden states,
and reranking (`/v1/rerank`), on a tiny random model and the default model."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import requests
import torch
from test_model_families import make_family_model

import sglite

TEXTS = ["w5 w9 w13 w7", "w100 w101 w102 w103 w104 w105 w106", "w5 w9 w13 w7 w8 w11"]


def reference(hf: torch.nn.Module, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the final norm), pooled and normalized."""
    with torch.no_grad():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0]
    pooled = states[-1] if pooling == "last" else states.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_engine_encode_matches_transformers(tmp_path, pooling):
    """Last-token and mean pooling; the prompts share a prefix, so the last-token batch reuses
    the cache (the third prompt extends the first) and mean pooling must not."""
    hf = make_family_model("qwen3", str(tmp_path))
    with sglite.Engine(
        model_path=str(tmp_path), dtype="float32", pooling=pooling, log_level="error"
    ) as engine:
        first = engine.encode(TEXTS[0])
        batch = engine.encode(TEXTS)
        ids = [engine.tokenizer.encode(t) for t in TEXTS]
        by_ids = engine.encode(input_ids=ids[1])
    assert isinstance(batch, list) and len(batch) == 3
    for result, prompt in zip(batch, ids, strict=True):
        want = reference(hf, prompt, pooling)
        torch.testing.assert_close(torch.tensor(result["embedding"]), want, atol=1e-4, rtol=0)
        assert result["meta_info"]["prompt_tokens"] == len(prompt)
    assert first["embedding"] == pytest.approx(batch[0]["embedding"], abs=1e-5)
    assert by_ids["embedding"] == pytest.approx(batch[1]["embedding"], abs=1e-5)
    if pooling == "mean":
        assert batch[2]["meta_info"]["cached_tokens"] == 0


@pytest.fixture(scope="module")
def client(sglite_server):
    return openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_embeddings_on_the_default_model(client, sglite_server, smollm2_transformers):
    from sglite.runtime.model.loader import load_tokenizer

    texts = ["The cat sat on the mat.", "A feline rested on the rug.", "Stocks fell today."]
    r = client.embeddings.create(model="default", input=texts)
    assert [d.index for d in r.data] == [0, 1, 2]
    vectors = torch.tensor([d.embedding for d in r.data])
    assert vectors.shape == (3, 576)
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(3), atol=1e-5, rtol=0)
    tok = load_tokenizer()
    for text, vector in zip(texts, vectors, strict=True):
        want = reference(smollm2_transformers, tok.encode(text), "last")
        assert float(vector @ want) > 0.9999  # int4 weights (the default) against float32
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    packed = client.embeddings.create(model="default", input=texts[0], encoding_format="base64")
    raw = packed.data[0].embedding
    if isinstance(raw, str):  # the client decodes base64 itself when numpy is around
        raw = list(struct.unpack(f"<{576}f", base64.b64decode(raw)))
    assert raw == pytest.approx(r.data[0].embedding, abs=1e-6)
    native = requests.post(sglite_server.url + "/encode", json={"text": texts}, timeout=60).json()
    assert native[1]["embedding"] == pytest.approx(r.data[1].embedding, abs=1e-6)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": "w " * 20000}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": [[1, 10**9]]}, "input"),
    ],
)
def test_bad_embedding_requests_answer_400(sglite_server, body, field):
    r = requests.post(sglite_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_rerank_scores_documents(sglite_server):
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower."]
    body = {"query": "What is the capital of France?", "documents": docs, "top_n": 2}
    r = requests.post(sglite_server.url + "/v1/rerank", json=body, timeout=120)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert all(0 < x["relevance_score"] < 1 for x in results)
    assert {x["document"]["text"] for x in results} <= set(docs)
    again = requests.post(sglite_server.url + "/v1/rerank", json=body, timeout=120).json()
    assert [x["relevance_score"] for x in again["results"]] == pytest.approx(
        [x["relevance_score"] for x in results], abs=1e-4
    )
    bad = requests.post(sglite_server.url + "/v1/rerank", json={"query": "q", "documents": []})
    assert bad.status_code == 400
