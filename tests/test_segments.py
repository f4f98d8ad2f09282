"""Reusable prompt segments (scheduler/segments.py) on the default model: a cached passage's KV
reused at another place in a prompt. With the recompute fraction at 1.0 the answer equals a
full prefill; below it the segments are reused in any order, never poison the exact-prefix
cache, are evicted like any cached tokens and come back."""

from __future__ import annotations

import math

import pytest
import torch

import sglite
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode, narrow_rows
from sglite.runtime.scheduler.io import check_segments
from sglite.runtime.scheduler.segment_selection import DeviationNarrowing, keep_counts
from sglite.runtime.scheduler.segments import plan_assembly, reused_spans
from sglite.runtime.server_args import ServerArgs

pytestmark = pytest.mark.slow

DOCS = [
    "Paris is the capital of France. It has the Eiffel Tower, the Louvre and many cafes. ",
    "Berlin is the capital of Germany. It is known for its history, clubs and art scene. ",
    "Madrid is the capital of Spain. It is famous for the Prado museum, parks and tapas. ",
]
QUESTION = "Question: which city has the Prado museum? Answer:"
GREEDY = {"max_new_tokens": 10, "temperature": 0}


def assemble(engine: sglite.Engine, order: list[int]) -> tuple[list[int], list[list[int]]]:
    """Token ids of 'Documents:' + the documents in `order` + the question, and the documents'
    token spans (each piece tokenized alone, as the server tokenizes a segmented text)."""
    tok = engine.tokenizer
    pieces = [tok.encode("Documents:\n")]
    pieces += [tok.hf.encode(DOCS[i], add_special_tokens=False) for i in order]
    pieces.append(tok.hf.encode(QUESTION, add_special_tokens=False))
    ids: list[int] = []
    spans = []
    for i, piece in enumerate(pieces):
        if 0 < i < len(pieces) - 1:
            spans.append([len(ids), len(ids) + len(piece)])
        ids += piece
    return ids, spans


def check(engine: sglite.Engine) -> dict:
    """The engine's statistics, after its KV accounting check (raises on a leak)."""
    engine.check_invariants()
    return engine.get_server_info()


@pytest.fixture(scope="module")
def exact_engine():
    with sglite.Engine(
        dtype="float32", gguf_activations="float", log_level="error", segment_recompute_fraction=1.0
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def reuse_engine():
    """The default fraction on a pool small enough that unrelated prompts evict segments."""
    with sglite.Engine(
        dtype="float32", gguf_activations="float", log_level="error", max_total_tokens=700
    ) as eng:
        yield eng


def test_the_plan_covers_every_token_once():
    reused = reused_spans([(2, 6), (8, 12), (14, 20)], exact=3)
    assert reused == [(8, 12), (14, 20)]  # (2, 6) reaches into the exact prefix
    plan = plan_assembly(20, 3, reused, recompute={8, 15, 16})
    assert plan.rows == [3, 4, 5, 6, 7, 8, 12, 13, 15, 16, 19]  # gaps, chosen, last token
    assert (plan.reused_tokens, plan.recomputed, plan.computed_tokens) == (6, 4, 7)
    assert (
        check_segments([[0, 4], [3, 6]], 10) == "segments[1] overlaps or precedes the one before it"
    )
    assert "not a non-empty span" in check_segments([[4, 4]], 10)


def test_the_selection_keeps_the_most_deviating_reused_tokens():
    # Once: ceil(f x S) after layer 1. Layerwise: from 1.5f down to 0.5f, the same mean.
    assert keep_counts(6, 10, 0.25, "once") == {1: 3}
    assert keep_counts(6, 8, 0.25, "layerwise") == {1: 3, 2: 3, 3: 2, 4: 1}
    assert sum(keep_counts(28, 100, 0.25, "layerwise").values()) / 26 == pytest.approx(25, abs=1)
    assert (
        keep_counts(6, 8, 0.75, "layerwise")[1] == 8
    )  # at f >= 0.5 layer 1 keeps them all (f >= 2/3)
    with pytest.raises(ValueError, match="selection must be one of"):
        keep_counts(6, 8, 0.25, "sometimes")
    # A prompt of 8 tokens: 0-1 exact, 2-6 reused (5 candidates), 7 the question's last token.
    pool = KVPool(16, 3, 1, 2, torch.float32)
    for layer in range(3):
        pool.k[layer].zero_(), pool.v[layer].zero_()
    slots = list(range(1, 9))
    candidate = torch.tensor([False, False, True, True, True, True, True, False])
    narrowing = DeviationNarrowing(candidate, {1: 2})
    batch = ForwardBatch.build(ForwardMode.EXTEND, [list(range(6))], [2], [slots], [5])
    narrowing.before_layer(0, batch, pool)
    assert narrowing.after_layer(0, batch, pool) is None  # no choice before layer 1
    narrowing.before_layer(1, batch, pool)
    moved = torch.tensor([0.5, 2.0, 0.5, 3.0, 0.5])  # positions 2..6; ties go to the earlier
    pool.k[1][slots[2:7]] += moved[:, None, None]
    keep = narrowing.after_layer(1, batch, pool)
    assert keep.tolist() == [1, 3, 5]  # rows of positions 3 and 5, and the last token's
    narrowing.before_layer(2, narrow_rows(batch, keep), pool)  # the model's next batch
    assert narrowing.recomputed == 2
    assert keep_counts(2, 5, 0.25, "once") == {}  # too shallow to narrow: every token computed
    assert DeviationNarrowing(candidate, {}).recomputed == 5


def test_full_recompute_equals_a_full_prefill(exact_engine):
    for order in ([0, 1, 2], [2, 0, 1]):
        ids, spans = assemble(exact_engine, order)
        plain = exact_engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        exact_engine.flush_cache()  # the segments are computed alone, then assembled
        seg = exact_engine.generate(
            input_ids=ids, sampling_params=GREEDY, return_logprob=True, segments=spans
        )
        assert seg["output_ids"] == plain["output_ids"]
        want = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
        got = [lp for lp, _, _ in seg["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)
        counts = seg["meta_info"]["segment_tokens"]
        assert counts["reused"] == 0 and counts["recomputed"] == sum(e - s for s, e in spans)
        check(exact_engine)


def test_segments_are_reused_in_any_order_and_never_poison_the_cache(reuse_engine):
    eng = reuse_engine
    eng.flush_cache()
    first_ids, first_spans = assemble(eng, [0, 1, 2])
    first = eng.generate(input_ids=first_ids, sampling_params=GREEDY, segments=first_spans)
    assert first["meta_info"]["segment_tokens"]["reused"] > 0
    before = check(eng)
    ids, spans = assemble(eng, [1, 2, 0])
    second = eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)
    after = check(eng)
    counts = second["meta_info"]["segment_tokens"]
    total = sum(e - s for s, e in spans)
    assert counts["reused"] + counts["recomputed"] == total
    assert counts["recomputed"] == math.ceil(ServerArgs.segment_recompute_fraction * total)
    # Only the rows were computed: no segment was prefilled again.
    rows = counts["recomputed"] + counts["computed"]
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == rows
    assert after["segment_reused_tokens"] - before["segment_reused_tokens"] == counts["reused"]
    # The assembled KV is approximate: a plain request for the same tokens matches exactly only
    # up to the first reused segment.
    plain = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert plain["meta_info"]["cached_tokens"] <= spans[0][0]
    assert "segment_tokens" not in plain["meta_info"]


def test_evicted_segments_come_back(reuse_engine):
    eng = reuse_engine
    ids, spans = assemble(eng, [2, 1, 0])
    eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)
    for i in range(4):  # unrelated prompts fill the 700-token pool: the segments are evicted
        eng.generate(f"{i} " + "filler words " * 100, {"max_new_tokens": 2})
    before = check(eng)
    again = eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)
    after = check(eng)
    assert again["meta_info"]["segment_tokens"]["reused"] > 0
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed > sum(e - s for s, e in spans)  # the segments were computed again
    assert after["evicted_tokens"] > 0


@pytest.fixture(scope="module")
def tiered_reuse_engine():
    """`reuse_engine`'s pool over a host tier that holds everything evicted from it."""
    from sglite.runtime.cache.kv_pool import KVPool

    token_bytes = KVPool.bytes_per_token(30, 3, 64, torch.float32)  # SmolLM2-135M, float32
    with sglite.Engine(
        dtype="float32",
        gguf_activations="float",
        log_level="error",
        max_total_tokens=700,
        hicache_size=4000 * token_bytes / 1e9,
        hicache_load_policy="always",
    ) as eng:
        yield eng


def test_segments_evicted_to_the_host_tier_are_loaded_back(tiered_reuse_engine):
    eng = tiered_reuse_engine
    ids, spans = assemble(eng, [2, 1, 0])
    first = eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)
    for i in range(4):  # the same fillers as above: the segments leave the pool for the host
        eng.generate(f"{i} " + "filler words " * 100, {"max_new_tokens": 2})
    before = check(eng)
    assert before["hicache"]["host"]["tokens"] > 0
    again = eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)
    after = check(eng)
    assert again["output_ids"] == first["output_ids"]
    counts = again["meta_info"]["segment_tokens"]
    assert counts["reused"] > 0
    # Each segment came back from the host: its fill computed only its last token, and the
    # assembly its rows.
    loaded = (
        after["hicache"]["host"]["promoted_tokens"] - before["hicache"]["host"]["promoted_tokens"]
    )
    assert loaded >= sum(e - s for s, e in spans)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed == counts["recomputed"] + counts["computed"] + len(spans)


def test_text_spans_and_bad_segments(reuse_engine):
    eng = reuse_engine
    text = "Documents:\n" + DOCS[0] + QUESTION
    start = len("Documents:\n")
    out = eng.generate(text, GREEDY, segments=[[start, start + len(DOCS[0])]])
    assert out["meta_info"]["segment_tokens"]["reused"] > 0
    for bad, needle in (
        ([[5, 2]], "not a non-empty span"),
        ([[0, 4], [2, 6]], "overlaps"),
        ([[0, 10**6]], "character"),
        ("0-4", "list of"),
    ):
        with pytest.raises(ValueError, match=needle):
            eng.generate(text, GREEDY, segments=bad)
    spans = [[start, start + len(DOCS[0])]]
    refused = eng.generate(text, GREEDY, segments=spans, return_logprob=True, logprob_start_len=0)
    assert "need a full prefill" in refused["meta_info"]["finish_reason"]["message"]
    check(eng)


@sglite.function
def rag(s, docs: list[str], question: str):
    s += "Documents:\n"
    for doc in docs:
        s += sglite.segment(doc)
    s += question + sglite.gen("answer", max_tokens=8, temperature=0)


def test_a_program_marks_segments_on_the_engine_and_over_http(reuse_engine, sglite_server):
    docs = [DOCS[2], DOCS[0]]
    state = rag.run(docs=docs, question=QUESTION, backend=reuse_engine)
    counts = state.get_meta_info("answer")["segment_tokens"]
    assert counts["reused"] > 0
    # The same text without segments is the same prompt, tokenized piece by piece or not.
    plain = reuse_engine.generate("Documents:\n" + "".join(docs) + QUESTION, GREEDY)
    assert "segment_tokens" not in plain["meta_info"]
    remote = rag.run(
        docs=docs, question=QUESTION, backend=sglite.RuntimeEndpoint(sglite_server.url)
    )
    assert remote.get_meta_info("answer")["segment_tokens"]["reused"] > 0
    assert remote["answer"]


def test_openai_chat_messages_marked_reuse(sglite_server):
    import openai
    import requests

    client = openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)
    info = lambda: requests.get(sglite_server.url + "/get_server_info", timeout=30).json()  # noqa: E731
    before = info()["segment_reused_tokens"]
    for doc in (DOCS[1], DOCS[0]):
        messages = [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": doc, "reuse": True},
            {"role": "user", "content": QUESTION},
        ]
        answer = client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0
        )
        assert answer.choices[0].message.content
    assert info()["segment_reused_tokens"] > before
    bad = [{"role": "user", "content": [{"type": "text", "text": DOCS[0]}], "reuse": True}]
    with pytest.raises(openai.BadRequestError, match="reuse"):
        client.chat.completions.create(model="m", messages=bad, max_tokens=2)


def test_requests_sharing_a_passage_share_its_fill(reuse_engine):
    eng = reuse_engine
    eng.flush_cache()
    batch = [assemble(eng, order) for order in ([0, 1], [1, 0], [0, 2], [2, 1])]
    before = check(eng)
    outs = eng.generate(
        input_ids=[ids for ids, _ in batch],
        sampling_params=GREEDY,
        segments=[spans for _, spans in batch],
    )
    assert all(o["meta_info"]["segment_tokens"]["reused"] > 0 for o in outs)
    after = check(eng)
    # Each of the three passages was prefilled once (plus the rows), and nothing is left queued:
    # the cache can be flushed at once.
    passages = sum(len(eng.tokenizer.hf.encode(d, add_special_tokens=False)) + 1 for d in DOCS)
    rows = sum(o["meta_info"]["segment_tokens"]["recomputed"] for o in outs)
    rows += sum(o["meta_info"]["segment_tokens"]["computed"] for o in outs)
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= passages + rows
    eng.flush_cache()


def test_layerwise_selection_recomputes_the_same_share_on_average():
    with pytest.raises(ValueError, match="segment_selection must be one of"):
        ServerArgs(segment_selection="sometimes").validate()
    with sglite.Engine(
        dtype="float32", gguf_activations="float", log_level="error", segment_selection="layerwise"
    ) as eng:
        ids, spans = assemble(eng, [0, 1, 2])
        eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)  # fills
        ids, spans = assemble(eng, [2, 0, 1])
        out = eng.generate(input_ids=ids, sampling_params=GREEDY, segments=spans)
        counts = out["meta_info"]["segment_tokens"]
        total = sum(e - s for s, e in spans)
        assert counts["reused"] + counts["recomputed"] == total
        # Per layer from 1.5f down to 0.5f of them, each count rounded up: f on average.
        share = ServerArgs.segment_recompute_fraction
        assert math.ceil(share * total) <= counts["recomputed"] <= math.ceil(share * total) + 1
        check(eng)
