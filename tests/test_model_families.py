"""Every model family against transformers on the same weights: tiny random models (a few layers,
fixed seed, weights scaled so argmax is decisive) built with transformers in a temp dir, loaded
from their Hugging Face directory and from a GGUF file written as llama.cpp's converter writes
one, compared on prompt logits and 24 greedy tokens per prompt, alone, in one batch and after a
cached prefix; the native decode step against the PyTorch path where the family runs it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_loader import _llamacpp_permute
from test_model_parity import (
    VOCAB,
    decode,
    extend,
    hf_greedy,
    hf_logits,
    new_pool,
    save_word_tokenizer,
)

from sglite.runtime.model.loader import LoadedModel, load_model

STEPS = 24
PROMPTS = [
    [1, 17, 45, 3, 99, 260, 7, 7, 12, 301, 88, 5, 150],
    [1, 200, 201, 202, 9],
    [1, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48],
]
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}
# family -> (transformers config and model class names, overrides, GGUF architecture or None)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, "qwen3"),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 32,
            "num_hidden_layers": 7,  # Gemma 3's pattern: layer 5 global, the others local
            "sliding_window": 6,
            "query_pre_attn_scalar": 32,
        },
        "gemma3",
    ),
    # The language model of a multimodal checkpoint (its vision tower is not loaded).
    "gemma3-vlm": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {"head_dim": 32, "sliding_window": 6, "query_pre_attn_scalar": 32},
        None,
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 9}, "phi3"),
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"rope_scaling": LONGROPE, "original_max_position_embeddings": 64},
        None,
    ),
    "llama3.2": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
        None,
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
        "llama",
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 40,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
        "qwen3moe",
    ),
}


def make_family_model(family: str, path: str) -> torch.nn.Module:
    """A tiny random transformers model of `family`, saved (with a tokenizer) under `path`."""
    import transformers

    config_name, model_name, overrides, _ = FAMILIES[family]
    if config_name == "Gemma3Config":  # a text config inside, and a tiny vision tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
        vision.update(num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(
            text_config={**COMMON, **overrides},
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=300,
            boi_token_index=301,
            eoi_token_index=302,
        )
    else:
        config = getattr(transformers, config_name)(**{**COMMON, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not the initial ones/zeros: the scales must load right
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model


# ------------------------------------------------------------------------------- GGUF writer

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_GEMMA_BLOCK = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_family_gguf(
    hf: torch.nn.Module, arch: str, path: str, raw: dict[str, tuple[np.ndarray, int]] | None = None
) -> None:
    """`hf` as llama.cpp's converter writes it (F32 tensors, so `hf` stays the exact
    reference): its names, Gemma's norms stored as 1 + w, Llama's Q/K rows interleaved, and
    each layer's experts in one 3D tensor per projection. `raw` maps GGUF tensor names to blocks
    and their GGML type, written instead."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_bool(f"{arch}.expert_weights_norm", getattr(cfg, "norm_topk_prob", True))
    for name, param in hf.state_dict().items():
        data = param.float().numpy().copy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        else:
            parts = name.split(".")  # model.layers.N.<module...>.<kind>
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if ".experts." in name:  # transformers' fused [experts, out, in] tensors
                prefix = f"blk.{layer}"
                if name.endswith("gate_up_proj"):
                    gate, up = np.split(data, 2, axis=1)
                    writer.add_tensor(f"{prefix}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                    writer.add_tensor(f"{prefix}.ffn_up_exps.weight", np.ascontiguousarray(up))
                else:
                    writer.add_tensor(f"{prefix}.ffn_down_exps.weight", data)
                continue
            table = {**_GGUF_BLOCK, **_GEMMA_BLOCK} if arch == "gemma3" else _GGUF_BLOCK
            gguf_name = f"blk.{layer}.{table[module]}.{kind}"
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        if arch == "llama" and ".q_proj." in name:
            data = _llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _llamacpp_permute(data, cfg.num_key_value_heads)
        if raw and gguf_name in raw:
            blocks, qtype = raw[gguf_name]
            writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            continue
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------------- runs


def greedy_batch(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of all prompts in one batch: one EXTEND, then batched DECODE steps."""
    pool = new_pool(loaded)
    logits, slots = extend(loaded, pool, prompts)
    out = [[int(row.argmax())] for row in logits]
    for _ in range(steps - 1):
        logits, slots = decode(loaded, pool, [o[-1] for o in out], slots)
        for o, row in zip(out, logits, strict=True):
            o.append(int(row.argmax()))
    return out


def greedy_after_prefix(loaded: LoadedModel, prompt: list[int], cut: int, steps: int) -> list[int]:
    """Greedy tokens when the prompt's first `cut` tokens are already cached in the pool."""
    pool = new_pool(loaded)
    _, cached = extend(loaded, pool, [prompt[:cut]])
    logits, slots = extend(loaded, pool, [prompt[cut:]], prefix_slots=cached)
    out = [int(logits[0].argmax())]
    for _ in range(steps - 1):
        logits, slots = decode(loaded, pool, [out[-1]], slots)
        out.append(int(logits[0].argmax()))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its reference tokens per prompt, our model from its HF dir)."""
    name = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf = make_family_model(name, path)
    refs = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    return name, hf, refs, load_model(path, "float32", progress=False)


def test_prompt_logits_match_transformers(family):
    _, hf, _, ours = family
    for prompt in PROMPTS:
        logits, _ = extend(ours, new_pool(ours), [prompt], all_rows=True)
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=2e-4, rtol=0)


def test_greedy_tokens_alone_batched_and_cached_match_transformers(family):
    _, _, refs, ours = family
    assert greedy_batch(ours, PROMPTS, STEPS) == refs
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        assert greedy_batch(ours, [prompt], STEPS) == [ref]
        assert greedy_after_prefix(ours, prompt, len(prompt) // 2 + 1, STEPS) == ref


def test_native_decode_step_matches_the_pytorch_path(family, monkeypatch):
    """Dense families decode in one native call per step (q/k norms, sandwich norms, GELU,
    per-layer RoPE included); mixture-of-experts layers take the PyTorch path."""
    from sglite.runtime.model import kernels
    from sglite.runtime.model.native_decode import NativeDecoder

    name, _, _, ours = family
    served: list[int] = []
    real = NativeDecoder.run

    def spy(self, residual, batch, pool):
        done = real(self, residual, batch, pool)
        served.extend([residual.shape[0]] if done else [])
        return done

    monkeypatch.setattr(NativeDecoder, "run", spy)

    def steps(native: bool) -> list[torch.Tensor]:
        ours.model.use_native_decode = native
        pool = new_pool(ours)
        logits, slots = extend(ours, pool, PROMPTS)
        out = []
        for tok in (11, 12, 13):
            logits, slots = decode(ours, pool, [tok] * len(PROMPTS), slots)
            out.append(logits)
        ours.model.use_native_decode = True
        return out

    native = steps(True)
    moe = ours.config.num_experts > 0
    expect_native = kernels.native_available() and not moe
    assert served == ([3, 3, 3] if expect_native else [])
    for a, b in zip(native, steps(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_gguf_file_matches_transformers(family, tmp_path):
    name, hf, refs, _ = family
    arch = FAMILIES[name][3]
    if arch is None:
        pytest.skip(f"{name}: covered by its Hugging Face directory (same family as another)")
    path = str(tmp_path / f"{name}.gguf")
    write_family_gguf(hf, arch, path)
    tokenizer = str(tmp_path / "tok")
    save_word_tokenizer(tokenizer)
    ours = load_model(path, "float32", tokenizer_path=tokenizer, progress=False)
    logits, _ = extend(ours, new_pool(ours), [PROMPTS[0]], all_rows=True)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[0]), atol=2e-4, rtol=0)
    assert greedy_batch(ours, PROMPTS, STEPS) == refs


def test_family_configs_read_their_own_fields(tmp_path):
    """What sets the families apart reaches the config (and nothing the shared layers cannot
    run is accepted silently)."""
    from sglite.runtime.model.hf_loader import hf_config

    cases = {
        "gemma3": lambda c: (
            c.qk_norm
            and c.sandwich_norms
            and c.hidden_act == "gelu_tanh"
            and c.sliding_window_layers == [0, 1, 2, 3, 4, 6]
            and c.local_rope_theta == 10000.0
            and c.rope_theta == 1e6
            and abs(c.embedding_multiplier - 8.0) < 1e-9
        ),
        "qwen3": lambda c: c.qk_norm and c.head_dim == 32 and not c.attention_bias,
        "qwen3-moe": lambda c: c.moe_layers == [0, 2] and not c.norm_topk_prob,
        "mixtral": lambda c: c.num_experts == 4 and c.moe_intermediate_size == 48,
        "phi3-longrope": lambda c: c.rope_scaling["original_max_position_embeddings"] == 64,
    }
    for name, check in cases.items():
        path = tmp_path / name
        make_family_model(name, str(path))
        _, config = hf_config(str(path))
        assert check(config), (name, config)


def test_unsupported_models_get_clear_errors(tmp_path):
    make_family_model("gemma3", str(tmp_path / "g"))
    config_file = tmp_path / "g" / "config.json"
    raw = json.loads(config_file.read_text())
    raw["final_logit_softcapping"] = 30.0
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        load_model(str(tmp_path / "g"), "float32", progress=False)
    raw["architectures"] = ["FalconForCausalLM"]
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'"):
        load_model(str(tmp_path / "g"), "float32", progress=False)
    make_family_model("qwen3", str(tmp_path / "q"))
    config_file = tmp_path / "q" / "config.json"
    raw = json.loads(config_file.read_text())
    del raw["num_hidden_layers"]
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_model(str(tmp_path / "q"), "float32", progress=False)
    assert os.path.isdir(tmp_path / "q")


QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant ' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think> </think> ' }}{%- endif %}{%- endif %}"
)


def test_qwen3_enable_thinking_reaches_its_chat_template(tmp_path):
    """Qwen3's template writes an empty think block when `enable_thinking` is false: the chat
    API passes `chat_template_kwargs` through to it (a real server, the openai client)."""
    import openai
    from server_fixtures import ServerProcess
    from transformers import AutoTokenizer

    path = tmp_path / "qwen3"
    make_family_model("qwen3", str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(str(path))
    server = ServerProcess("--model-path", str(path))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        messages = [{"role": "user", "content": "w5 w6"}]

        def prompt_tokens(**extra) -> int:
            answer = client.chat.completions.create(
                model=str(path), messages=messages, max_tokens=1, extra_body=extra
            )
            return answer.usage.prompt_tokens

        thinking = prompt_tokens()
        block = len(tok.encode("<think> </think>", add_special_tokens=False))
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == thinking + block
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == thinking
    finally:
        server.stop()


def test_unreadable_gguf_files_get_clear_errors(tmp_path):
    """A GGUF of an unsupported architecture, or holding a tensor type the `gguf` package
    cannot dequantize, is refused with an error naming what is wrong."""
    import gguf

    hf = make_family_model("qwen3", str(tmp_path / "hf"))
    tokenizer = str(tmp_path / "hf")
    write_family_gguf(hf, "falcon", str(tmp_path / "falcon.gguf"))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(tmp_path / "falcon.gguf"), "float32", tokenizer_path=tokenizer)
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    blocks = np.zeros((64, 128 // block * size), dtype=np.uint8)  # down_proj: [64, 128]
    path = str(tmp_path / "q8_1.gguf")
    write_family_gguf(hf, "qwen3", path, raw={"blk.0.ffn_down.weight": (blocks, q8_1)})
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight"):
        load_model(path, "float32", tokenizer_path=tokenizer, progress=False)


def test_expert_routing_does_not_depend_on_the_batch():
    """A token picks the same experts with bitwise the same weights alone, in a prefill of 37
    rows, or among other decode rows: near-ties cannot flip with the batch's shape."""
    from sglite.runtime.model.config import ModelConfig
    from sglite.runtime.model.layers.moe import SparseMoE

    config = ModelConfig(
        arch="MixtralForCausalLM",
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    torch.manual_seed(0)
    moe = SparseMoE(config)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    x = torch.randn(37, 96)
    experts, weights = moe.route(x)
    for rows in ([5], [5, 6, 7], list(range(0, 37, 4))):
        e, w = moe.route(x[rows])
        assert torch.equal(e, experts[rows]) and torch.equal(w, weights[rows])
