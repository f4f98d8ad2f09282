"""The native EXTEND (prefill) attention kernel agrees with SDPA in float32 on every shape the
model feeds it: several sequences with and without cached prefixes, GQA groups, head sizes,
sliding windows; and a model prefilled through it gives the logits of the PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglite.runtime.model import attention, kernels


def _layout(seqs: list[tuple[torch.Tensor, int, int, int]]) -> kernels.ExtendLayout:
    offsets, total = [], 0
    for slots, *_ in seqs:
        offsets.append(total)
        total += len(slots)
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return kernels.ExtendLayout(
        slots=torch.cat([s for s, *_ in seqs]),
        slot_offsets=as_long(offsets),
        q_starts=as_long([s[1] for s in seqs]),
        prefix_lens=as_long([s[2] for s in seqs]),
        extend_lens=as_long([s[3] for s in seqs]),
    )


def _native_serves_bf16() -> bool:
    """The kernel needs AVX512-BF16; elsewhere it declines and SDPA runs."""
    if not kernels.native_available():
        return False
    pool = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    layout = _layout([(torch.tensor([1]), 0, 0, 1)])
    q = torch.zeros(1, 64, dtype=torch.bfloat16)
    return kernels.extend_attention(q, pool, pool, layout, 1, 1.0, None) is not None


pytestmark = pytest.mark.skipif(not _native_serves_bf16(), reason="needs AVX512-BF16")


def _reference(q, k_cache, v_cache, seqs, heads, scale, window):
    """float32 SDPA per sequence with an explicit causal (and window) mask."""
    out = torch.zeros(q.shape[0], heads, q.shape[1] // heads)
    for slots, start, prefix, ext in seqs:
        qi = q[start : start + ext].float().view(ext, heads, -1).transpose(0, 1)
        k = k_cache[slots].float().transpose(0, 1)
        v = v_cache[slots].float().transpose(0, 1)
        q_pos = torch.arange(prefix, prefix + ext)[:, None]
        k_pos = torch.arange(len(slots))[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + ext] = o.transpose(0, 1)
    return out.flatten(1)


CASES = [
    # heads, kv_heads, head_dim, [(prefix, new tokens) per sequence], window
    (9, 3, 64, [(0, 700)], None),
    (9, 3, 64, [(0, 5)], None),
    (9, 3, 64, [(100, 1), (0, 33), (50, 64), (999, 200)], None),
    (4, 4, 64, [(10, 100)], None),
    (8, 1, 128, [(30, 70)], None),
    (14, 2, 64, [(0, 100), (3, 17)], None),  # 7 query heads per kv head
    (32, 8, 128, [(0, 130)], None),
    (9, 3, 64, [(0, 300), (200, 100)], 64),
    (9, 3, 64, [(0, 40)], 1),
]


@pytest.mark.parametrize("heads, kv_heads, dim, specs, window", CASES)
def test_extend_attention_matches_sdpa(heads, kv_heads, dim, specs, window):
    torch.manual_seed(len(specs) * 1000 + heads)
    pool = 4000
    k_cache = torch.randn(pool, kv_heads, dim).bfloat16()
    v_cache = torch.randn(pool, kv_heads, dim).bfloat16()
    free = torch.randperm(pool - 1) + 1  # slots in random order, as the pool hands them out
    tokens = sum(ext for _, ext in specs)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).bfloat16()
    q = qkv[:, : heads * dim]  # a strided view, as the model passes it
    seqs, used, start = [], 0, 0
    for prefix, ext in specs:
        seqs.append((free[used : used + prefix + ext], start, prefix, ext))
        used += prefix + ext
        start += ext
    scale = dim**-0.5
    ours = kernels.extend_attention(q, k_cache, v_cache, _layout(seqs), heads, scale, window)
    assert ours is not None
    ref = _reference(q, k_cache, v_cache, seqs, heads, scale, window)
    # bf16 output (8 bits of mantissa) of values of magnitude ~1
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)


def test_extend_attention_declines_what_it_cannot_serve():
    slots = torch.arange(1, 9)
    layout = _layout([(slots, 0, 0, 8)])
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 32)):
        cache = torch.zeros(10, 1, dim, dtype=dtype)
        q = torch.zeros(8, dim, dtype=dtype)
        assert kernels.extend_attention(q, cache, cache, layout, 1, 1.0, None) is None


def test_model_prefill_is_as_accurate_as_sdpa(monkeypatch):
    """A prompt prefilled in two parts (the second over the cached first): against the float32
    model, the bfloat16 model's logits are as close through the native kernel as through SDPA."""
    from pathlib import Path

    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
    from sglite.runtime.model.loader import load_model

    exact = load_model(None, "float32", progress=False)
    text = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    prompt = exact.tokenizer.encode(text)[:400]
    n = len(prompt)

    def run(loaded) -> torch.Tensor:
        cfg = loaded.config
        pool = KVPool(1024, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, "cpu")
        slots = list(range(1, n + 1))
        build = ForwardBatch.build
        first = build(ForwardMode.EXTEND, [prompt[:250]], [0], [slots[:250]], list(range(250)))
        rest = build(ForwardMode.EXTEND, [prompt[250:]], [250], [slots], list(range(n - 250)))
        return torch.cat([loaded.model.forward(first, pool), loaded.model.forward(rest, pool)])

    reference = run(exact)
    bf16 = load_model(None, "bfloat16", progress=False)
    native = run(bf16)
    monkeypatch.setattr(attention.kernels, "extend_attention", lambda *a, **k: None)
    sdpa = run(bf16)

    def error(logits: torch.Tensor) -> tuple[float, float]:
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        return (logits - reference).abs().mean().item(), agree

    (native_err, native_agree), (sdpa_err, sdpa_agree) = error(native), error(sdpa)
    assert native_err < 1.2 * sdpa_err
    assert native_agree >= sdpa_agree - 0.02
