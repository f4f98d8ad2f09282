"""Sampling, stop conditions and logprobs through the real Engine on the default model."""

from __future__ import annotations

import math

import pytest
import torch

PROMPT = "Here is a list of fruits: apple, banana,"


def test_seed_reproducible_and_distinct(engine):
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 1234}
    a = engine.generate(PROMPT, params)
    b = engine.generate([PROMPT, "Other traffic in the same batch"], [params, params])[0]
    assert a["output_ids"] == b["output_ids"], "a seed must not depend on batch neighbours"
    c = engine.generate(PROMPT, {**params, "seed": 99})
    assert c["output_ids"] != a["output_ids"]


def test_temperature_zero_is_deterministic(engine):
    outs = engine.generate([PROMPT] * 3, {"temperature": 0, "max_new_tokens": 10})
    assert len({tuple(o["output_ids"]) for o in outs}) == 1


def test_stop_string_trims_exactly(engine):
    free = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24})
    text = free["text"]
    stop = text[8:12]
    assert stop.strip(), f"need a visible stop string, got {text!r}"
    cut = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "stop": stop})
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate(
        PROMPT, {"temperature": 0, "max_new_tokens": 24, "stop": stop, "no_stop_trim": True}
    )
    # no_stop_trim keeps the stop string (up to the end of the token that completed it).
    assert kept["text"].startswith(text[: text.index(stop) + len(stop)])
    assert text.startswith(kept["text"])


def test_stop_string_in_stream_is_never_sent(engine):
    free = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24})["text"]
    stop = free[8:12]
    chunks = list(
        engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "stop": stop}, stream=True)
    )
    assert all(stop not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == free[: free.index(stop)]


def test_stop_token_ids_and_regex(engine):
    free = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16})
    ids = free["output_ids"]
    by_id = engine.generate(
        PROMPT, {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [ids[3]]}
    )
    assert by_id["output_ids"] == ids[: ids.index(ids[3]) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
    by_re = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16, "stop_regex": r"[,.]"})
    assert "," not in by_re["text"] and "." not in by_re["text"]
    assert by_re["meta_info"]["finish_reason"]["type"] == "stop"


def test_min_new_tokens_and_ignore_eos(engine):
    out = engine.generate("Say hi.", {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 40
    out = engine.generate("Say hi.", {"temperature": 0, "max_new_tokens": 40, "min_new_tokens": 30})
    assert out["meta_info"]["completion_tokens"] >= 30


def _reference_logits(token_ids: list[int]) -> torch.Tensor:
    """Full-prompt float32 logits from our own model loaded in this process (no cache)."""
    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
    from sglite.runtime.model.loader import load_model

    ref = load_model(None, "float32", "cpu", progress=False)
    cfg = ref.config
    pool = KVPool(len(token_ids) + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    slots = pool.alloc(len(token_ids))
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, [token_ids], [0], [slots], list(range(len(token_ids)))
    )
    with torch.inference_mode():
        return ref.model(fb, pool)


def test_logprobs_equal_log_softmax_of_reference_logits(engine):
    prompt_ids = engine.tokenizer.encode(PROMPT)
    out = engine.generate(
        input_ids=prompt_ids,
        sampling_params={"temperature": 0, "max_new_tokens": 6},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    full = prompt_ids + out["output_ids"]
    ref = torch.log_softmax(_reference_logits(full), dim=-1)
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(prompt_ids) and inp[0][0] is None
    for pos in range(1, len(prompt_ids)):
        value, tok, text = inp[pos]
        assert tok == prompt_ids[pos] and isinstance(text, str)
        assert math.isclose(value, ref[pos - 1, tok].item(), abs_tol=2e-3)
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    for i, (value, tok, _) in enumerate(outp):
        assert math.isclose(value, ref[len(prompt_ids) - 1 + i, tok].item(), abs_tol=2e-3)
        top = meta["output_top_logprobs"][i]
        assert len(top) == 3 and top[0][1] == tok  # greedy: the chosen token is the top one
        assert top[0][0] >= top[1][0] >= top[2][0]


def test_select_style_logprob_request(engine):
    """The request shape SGLang's `select` sends: prefill-only batch from prompt_tokens - 2."""
    prefix = "The sky is"
    n_prompt = engine.generate(prefix, {"max_new_tokens": 0})["meta_info"]["prompt_tokens"]
    choices = [" blue", " green", " made of cheese"]
    outs = engine.generate(
        [prefix + c for c in choices],
        {"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=n_prompt - 2,
        return_text_in_logprobs=True,
    )
    scores = []
    for out in outs:
        lps = out["meta_info"]["input_token_logprobs"]
        assert lps[0][0] is None and out["text"] == ""
        values = [v for v, _, _ in lps if v is not None]
        scores.append(sum(values) / len(values))
    assert scores.index(max(scores)) == 0, scores


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_penalties_lower_repeated_tokens(engine, penalty):
    prompt = "Repeat after me: the the the the the the the the"
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    base = engine.generate(prompt, params, return_logprob=True)
    pen = engine.generate(prompt, {**params, penalty: 1.5}, return_logprob=True)
    if pen["output_ids"] != base["output_ids"]:
        assert len(set(pen["output_ids"])) > len(set(base["output_ids"]))
        return
    # Same tokens chosen: the penalty must still have lowered their probability once repeated.
    base_lp = [v for v, _, _ in base["meta_info"]["output_token_logprobs"]]
    pen_lp = [v for v, _, _ in pen["meta_info"]["output_token_logprobs"]]
    assert all(p < b - 1e-3 for p, b in zip(pen_lp[1:], base_lp[1:])), (pen_lp, base_lp)
