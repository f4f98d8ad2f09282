"""Deterministic inference (`enable_deterministic_inference`): one request's greedy tokens and
logprobs are bitwise the same alone and in batches of up to 32 with other neighbours, after
cached prefixes of several lengths, with chunked prefill, with jump-forward and speculative
verification on or off, and on one or two threads, in float32 and in bfloat16 (which PyTorch
and the native kernels compute on any CPU; AVX-512 BF16 hosts run their own kernel paths
through the same tests)."""

from __future__ import annotations

import json

import pytest

import sglite

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTION = CHAT.format(
    "The old lighthouse stood on the northern cliff for two hundred years. Every night its "
    "keeper climbed the ninety steps, trimmed the wick and wound the clockwork that turned the "
    "great lens. Why did ships passing the reef need the beam? Answer in two sentences."
)
NEIGHBOURS = [
    CHAT.format(f"Write a haiku about the number {i}.") + "Sure" * (i % 5) for i in range(31)
]
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "keeper": {"type": "string", "maxLength": 8},
            "steps": {"type": "integer"},
        },
        "required": ["keeper", "steps"],
        "additionalProperties": False,
    }
)
GREEDY = {"temperature": 0, "max_new_tokens": 20}


def _engine(dtype: str, **kwargs) -> sglite.Engine:
    return sglite.Engine(
        dtype=dtype,
        enable_deterministic_inference=True,
        max_total_tokens=6000,
        log_level="error",
        **kwargs,
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request):
    """Two deterministic engines on the default model: one plain, one that splits prompts
    into chunks of 48 tokens, verifies n-gram drafts, decodes grammars token by token and runs
    on one thread."""
    plain = _engine(request.param, num_threads=2)
    other = _engine(
        request.param,
        num_threads=1,
        chunked_prefill_size=48,
        disable_jump_forward=True,
        speculative_algorithm="ngram",
        speculative_adaptive=False,
    )
    yield plain, other
    plain.shutdown()
    other.shutdown()


def _answer(out: dict) -> tuple[list[int], list[float], list]:
    meta = out["meta_info"]
    logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    return out["output_ids"], logprobs, meta.get("output_top_logprobs")


def _ask(engine, prompt=QUESTION, params=GREEDY, **kwargs) -> tuple:
    out = engine.generate(prompt, params, return_logprob=True, top_logprobs_num=3, **kwargs)
    return _answer(out)


def test_alone_batched_cached_chunked_and_on_one_thread_are_bitwise_equal(engines):
    plain, other = engines
    plain.flush_cache()
    reference = _ask(plain)
    assert len(reference[0]) == GREEDY["max_new_tokens"]
    assert _ask(plain) == reference  # its whole prompt but the last token now cached
    # Neighbours of other lengths, decoding alongside (bf16 rows go 8 at a time through the
    # GEMVs, so 16 already spans chunks; 32 costs this host's emulated bf16 twice as long).
    sizes = (4, 32) if plain.get_server_info()["dtype"] == "float32" else (4, 16)
    for size in sizes:
        prompts = [QUESTION, *NEIGHBOURS[: size - 1]]
        outs = plain.generate(prompts, [GREEDY] * size, return_logprob=True, top_logprobs_num=3)
        assert _answer(outs[0]) == reference, size
    for chars in (30, 130, 230):  # a cached prefix of several lengths
        plain.flush_cache()
        plain.generate(QUESTION[:chars], {"temperature": 0, "max_new_tokens": 1})
        assert (
            plain.generate(QUESTION, {**GREEDY, "max_new_tokens": 1})["meta_info"]["cached_tokens"]
            > 0
        )
        plain.flush_cache()
        plain.generate(QUESTION[:chars], {"temperature": 0, "max_new_tokens": 1})
        assert _ask(plain) == reference, chars
    other.flush_cache()
    assert _ask(other) == reference  # chunks of 48, drafts verified, one thread
    assert _ask(other) == reference


def test_grammar_with_and_without_jump_forward(engines):
    plain, other = engines
    params = {**GREEDY, "max_new_tokens": 40, "json_schema": SCHEMA}
    with_jump = plain.generate(QUESTION, params, return_logprob=True)
    without = other.generate(QUESTION, params, return_logprob=True)
    assert with_jump["meta_info"]["jump_forward_accepted_tokens"] > 0
    assert with_jump["output_ids"] == without["output_ids"]
    ours = [lp for lp, _, _ in with_jump["meta_info"]["output_token_logprobs"]]
    theirs = [lp for lp, _, _ in without["meta_info"]["output_token_logprobs"]]
    assert ours == theirs
    assert set(json.loads(with_jump["text"])) >= {"keeper", "steps"}


def test_seeded_samples_do_not_depend_on_the_batch(engines):
    plain, other = engines
    story = CHAT.format("Tell me a story about a fox.")
    params = [{"temperature": 1.2, "max_new_tokens": 16, "seed": 7 + i} for i in range(4)]
    alone = [plain.generate(story, p)["output_ids"] for p in params]
    together = plain.generate([story] * 4, params)
    assert [o["output_ids"] for o in together] == alone
    assert len({tuple(a) for a in alone}) > 1  # the seeds really differ
    assert [o["output_ids"] for o in other.generate([story] * 4, params)] == alone


def test_settings_that_cannot_be_deterministic_are_refused():
    with pytest.raises(ValueError, match="w4a8"):
        sglite.Engine(enable_deterministic_inference=True, quantization="w4a8")
    with pytest.raises(ValueError, match="quantized_max_rows"):
        sglite.Engine(enable_deterministic_inference=True, quantized_max_rows=8)


def test_a_dense_model_is_batch_invariant_too(tmp_path):
    """A tiny random Hugging Face Llama in bf16: dense weights, its rows through the native
    dense GEMV in chunks of 8 (float32 dense weights take the panel GEMM, whose rows are
    independent like the quantized GEMM's the default model tests)."""
    from test_loader import PROMPT, make_hf_model

    path = str(tmp_path / "tiny")
    make_hf_model("llama", path, num_hidden_layers=2)
    engine = sglite.Engine(
        model_path=path, dtype="bfloat16", enable_deterministic_inference=True, log_level="error"
    )
    try:
        params = {"temperature": 0, "max_new_tokens": 12}
        alone = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
        others = [PROMPT[2:], PROMPT[:4] * 3, PROMPT[1:7]]
        batch = engine.generate(
            input_ids=[PROMPT, *others], sampling_params=[params] * 4, return_logprob=True
        )
        assert _answer(batch[0]) == _answer(alone)
    finally:
        engine.shutdown()
