"""Our model forward against Hugging Face transformers on the same weights.

Tiny random Llama / Qwen2 / Mistral models are built with transformers and saved to a temp dir;
the default SmolLM2 GGUF is compared end to end (greedy tokens).
"""

from __future__ import annotations

import pytest
import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.load_options import cpu_has_native_bf16
from sglite.runtime.model.loader import LoadedModel, load_model

VOCAB = 320
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]


def save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer over `WORDS`, with a chat template, saved in HF format."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)


def make_hf_model(kind: str, path: str, **overrides) -> torch.nn.Module:
    """A tiny random transformers model of `kind`, saved (with a tokenizer) under `path`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    params = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Large weights give peaked logits, so greedy choices are not decided by rounding noise.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**params)).eval()
    if kind == "qwen2":  # zero-initialized biases would not exercise the bias path
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits `[len(ids), vocab]` of the transformers model for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def new_pool(loaded: LoadedModel, capacity: int = 2048) -> KVPool:
    """A KV pool sized for tests."""
    cfg = loaded.config
    return KVPool(capacity, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)


def extend(
    loaded: LoadedModel,
    pool: KVPool,
    seqs: list[list[int]],
    prefix_slots: list[list[int]] | None = None,
    all_rows: bool = False,
) -> tuple[torch.Tensor, list[list[int]]]:
    """EXTEND `seqs` (new tokens) after their cached prefixes; returns logits and the slot lists.

    With `all_rows` the logits of every new token are returned, else the last of each sequence.
    """
    prefix_slots = prefix_slots or [[] for _ in seqs]
    slots = [p + pool.alloc(len(s)) for p, s in zip(prefix_slots, seqs, strict=True)]
    if all_rows:
        rows = list(range(sum(len(s) for s in seqs)))
    else:
        ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
        rows = ends.tolist()
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, seqs, [len(p) for p in prefix_slots], slots, rows
    )
    return loaded.model(batch, pool), slots


def decode(
    loaded: LoadedModel, pool: KVPool, tokens: list[int], slots: list[list[int]]
) -> tuple[torch.Tensor, list[list[int]]]:
    """One DECODE step: `tokens[i]` is appended to sequence i (whose K/V sit at `slots[i]`)."""
    slots = [s + pool.alloc(1) for s in slots]
    batch = ForwardBatch.build(
        ForwardMode.DECODE,
        [[t] for t in tokens],
        [len(s) - 1 for s in slots],
        slots,
        list(range(len(tokens))),
    )
    return loaded.model(batch, pool), slots


def greedy(loaded: LoadedModel, pool: KVPool, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens through our EXTEND then DECODE path."""
    logits, slots = extend(loaded, pool, [prompt])
    out = [int(logits[0].argmax())]
    for _ in range(steps - 1):
        logits, slots = decode(loaded, pool, [out[-1]], slots)
        out.append(int(logits[0].argmax()))
    pool.free(slots[0])
    return out


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of the transformers model (full recompute each step: no cache involved)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def hf_greedy_cached(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of the transformers model using its own KV cache (fast for real models)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


PROMPT = [1, 17, 45, 3, 99, 260, 7, 7, 12, 301, 88, 5, 150]

VARIANTS = {
    "llama": ("llama", {}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3-rope": (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-window": ("mistral", {"sliding_window": 6}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(transformers model, our loaded model) for each tiny architecture variant, float32."""
    kind, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_hf_model(kind, path, **overrides)
    return hf, load_model(path, "float32", progress=False)


def test_prompt_logits_match_transformers(tiny):
    hf, ours = tiny
    pool = new_pool(ours)
    logits, _ = extend(ours, pool, [PROMPT], all_rows=True)
    assert logits.dtype == torch.float32
    assert logits.shape == (len(PROMPT), VOCAB)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_greedy_extend_then_decode_matches_transformers(tiny):
    hf, ours = tiny
    pool = new_pool(ours)
    assert greedy(ours, pool, PROMPT, 10) == hf_greedy(hf, PROMPT, 10)
    assert pool.num_free == pool.capacity


def test_pytorch_kernels_match_native_kernels(tiny, monkeypatch):
    """The fallback path (CUDA, no compiler) computes what the native CPU kernels compute."""
    from sglite.runtime.model.kernels import native

    _, ours = tiny
    pool = new_pool(ours)

    def run() -> list[torch.Tensor]:
        logits, slots = extend(ours, pool, [PROMPT, PROMPT[:5]], all_rows=True)
        out = [logits]
        for tok in (3, 4, 5):
            logits, slots = decode(ours, pool, [tok, tok], slots)
            out.append(logits)
        for s in slots:
            pool.free(s)
        return out

    native_out = run()
    monkeypatch.setattr(native, "load", lambda: None)
    monkeypatch.setattr(ours.model, "use_native_decode", False)
    for a, b in zip(native_out, run(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_split_extend_equals_single_extend(tiny):
    _, ours = tiny
    pool = new_pool(ours)
    whole, _ = extend(ours, pool, [PROMPT], all_rows=True)
    cut = 7
    _, first_slots = extend(ours, pool, [PROMPT[:cut]])
    second, _ = extend(ours, pool, [PROMPT[cut:]], prefix_slots=first_slots, all_rows=True)
    torch.testing.assert_close(second, whole[cut:], atol=1e-4, rtol=0)


def test_batched_extend_and_decode_equal_single_runs(tiny):
    _, ours = tiny
    pool = new_pool(ours)
    prompts = [PROMPT, PROMPT[:4], [1, 200, 201, 202, 203, 204, 205, 206, 207, 208, 9]]
    # Alone: extend then 4 decode steps each.
    alone = []
    for p in prompts:
        logits, slots = extend(ours, pool, [p])
        steps = [logits[0]]
        for tok in (11, 12, 13, 14):
            logits, slots = decode(ours, pool, [tok], slots)
            steps.append(logits[0])
        alone.append(torch.stack(steps))
    # Together: one batched extend (one sequence with a cached prefix), then batched decodes.
    _, cached = extend(ours, pool, [prompts[2][:5]])
    logits, slots = extend(
        ours, pool, [prompts[0], prompts[1], prompts[2][5:]], prefix_slots=[[], [], cached[0]]
    )
    together = [logits]
    for tok in (11, 12, 13, 14):
        logits, slots = decode(ours, pool, [tok] * 3, slots)
        together.append(logits)
    stacked = torch.stack(together, dim=1)  # [3, steps, vocab]
    for i in range(3):
        torch.testing.assert_close(stacked[i], alone[i], atol=1e-4, rtol=0)


def test_sliding_window_masks_old_tokens(tmp_path):
    """Mistral with a window shorter than the prompt: a distant token must not matter."""
    hf = make_hf_model("mistral", str(tmp_path), sliding_window=4, num_hidden_layers=1)
    ours = load_model(str(tmp_path), "float32", progress=False)
    a, b = [5] + PROMPT[1:], [6] + PROMPT[1:]
    pool = new_pool(ours)
    la, _ = extend(ours, pool, [a])
    lb, _ = extend(ours, pool, [b])
    # One layer with window 4: the last token's output only sees the last 4 tokens.
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=0)
    torch.testing.assert_close(la[0], hf_logits(hf, a)[-1], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ SmolLM2 (GGUF)

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
]
SMOL_STEPS = 20


@pytest.fixture(scope="module")
def smollm2(smollm2_transformers):
    """Our SmolLM2 in float32, and the transformers model from the same GGUF (float32)."""
    return load_model(None, "float32", progress=False), smollm2_transformers


def _chat_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    return loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages))


def test_smollm2_greedy_matches_transformers(smollm2):
    ours, hf = smollm2
    pool = new_pool(ours)
    for messages in CHAT_PROMPTS:
        ids = _chat_ids(ours, messages)
        # Plain argmax (no generate(): its eos handling would stop or mask tokens early).
        ref = hf_greedy_cached(hf, ids, SMOL_STEPS)
        got = greedy(ours, pool, ids, SMOL_STEPS)
        assert got == ref, (ours.tokenizer.decode(got), ours.tokenizer.decode(ref))


@pytest.mark.slow
def test_smollm2_bf16_agreement_report(smollm2):
    """Reported, not asserted strictly: bf16 logits are rounded to steps of 0.125 near 25, so a
    near-tie (SmolLM2's first answer token on the first prompt is one) can flip."""
    if not cpu_has_native_bf16():
        # Emulated bf16 is ~150x slower than float32 and never the default there; the bf16
        # paths run anywhere in test_native_decode.py and test_deterministic.py.
        pytest.skip("a report for hosts with native bf16 (AVX512-BF16 or AMX)")
    ours32, _ = smollm2
    ours16 = load_model(None, "bfloat16", progress=False)
    pool32, pool16 = new_pool(ours32), new_pool(ours16)
    prompts, steps = CHAT_PROMPTS, SMOL_STEPS
    agree, errors = [], []
    for messages in prompts:
        ids = _chat_ids(ours32, messages)
        l32, _ = extend(ours32, pool32, [ids])
        l16, _ = extend(ours16, pool16, [ids])
        errors.append(float((l32 - l16).abs().mean()))
        # Sanity, not parity: fp32's choice is among bf16's top few.
        assert int(l32[0].argmax()) in l16[0].topk(5).indices.tolist()
        a = greedy(ours32, pool32, ids, steps)
        b = greedy(ours16, pool16, ids, steps)
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), steps))
    print(
        f"\nbf16 vs float32: identical leading greedy tokens per prompt {agree} / {steps}; "
        f"mean |logit diff| at the last prompt token {[round(e, 3) for e in errors]}"
    )
    assert max(errors) < 0.5


def test_smollm2_prompt_logits_close_to_transformers(smollm2):
    ours, hf = smollm2
    ids = _chat_ids(ours, CHAT_PROMPTS[0])
    logits, _ = extend(ours, new_pool(ours), [ids], all_rows=True)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-3, rtol=1e-4)
