"""The native CPU kernels agree with their PyTorch formulations (float32 and bfloat16), and the
model gives the same logits with the kernels and without them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sglite.runtime.model import kernels
from sglite.runtime.model.kernels import native

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="no C compiler")

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm(dtype, tol, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 576, dtype=dtype)
    residual = torch.randn(rows, 576, dtype=dtype)
    weight = torch.randn(576, dtype=dtype)
    ours_res = residual.clone()
    ours = kernels.add_rms_norm(x, ours_res, weight, 1e-5)
    ref_res = residual + x
    ref = F.rms_norm(ref_res.float(), (576,), weight.float(), 1e-5)
    _close(ours_res, ref_res, 0)  # the residual sum is rounded exactly like `residual + x`
    _close(ours, ref, tol * 4)
    plain = kernels.add_rms_norm(None, residual.clone(), weight, 1e-5)
    _close(plain, F.rms_norm(residual.float(), (576,), weight.float(), 1e-5), tol * 4)


@pytest.mark.parametrize("n", [1, 63, 64, 49152])
def test_row_max_matches_torch_max(n):
    """Greedy sampling's argmax: values and first indices as torch.max gives them, NaN rows
    reported with NaN (the sampler fails such a row), ties resolved to the first index."""
    torch.manual_seed(n)
    x = torch.randn(6, n)
    x[1, n // 3] = float("nan")
    x[2] = float("-inf")
    x[3, n - 1] = float("inf")
    x[4, -1] = x[4, 0] = x[4].max() + 1  # a tie: the first one wins
    x[5, n // 2 :] = float("nan")
    values, indices = kernels.row_max(x)
    ref = x.max(dim=-1)
    assert torch.equal(indices, ref.indices)
    torch.testing.assert_close(values, ref.values, equal_nan=True)
    assert kernels.row_max(x.to(torch.bfloat16)) is None  # float32 only: the caller falls back


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activations(dtype, tol, rows, act):
    gate_up = 3 * torch.randn(rows, 2 * 1536 + 2, dtype=dtype)  # a scalar tail too
    gate, up = gate_up.float().split(1536 + 1, dim=-1)
    ref = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    _close(kernels.gated_act(gate_up, act), ref * up, tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_head_rms_norm_normalizes_q_and_k_heads_in_place(dtype, tol):
    heads, kv_heads, dim, eps = 4, 2, 64, 1e-6
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q_w, k_w = torch.rand(dim, dtype=dtype) + 0.5, torch.rand(dim, dtype=dtype) + 0.5
    ref = qkv.float().clone()
    q = ref[:, : heads * dim].view(5, heads, dim)
    k = ref[:, heads * dim : (heads + kv_heads) * dim].view(5, kv_heads, dim)
    q.copy_(F.rms_norm(q, (dim,), q_w.float(), eps))
    k.copy_(F.rms_norm(k, (dim,), k_w.float(), eps))
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    kernels.head_rms_norm(qkv, q_w, k_w, heads, kv_heads, eps)
    _close(qkv, ref, tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


@pytest.mark.parametrize("dtype, ulp", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
@pytest.mark.parametrize("tokens", [1, 9, 700])
def test_rope_store_kv_matches_torch(dtype, ulp, tokens):
    heads, kv_heads, dim = 9, 3, 64
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.randint(0, 4000, (tokens,))
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(4096).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(2000)[:tokens] + 1
    caches = [torch.zeros(2001, kv_heads, dim, dtype=dtype) for _ in range(4)]
    ours = qkv.clone()
    kernels.rope_store_kv(ours, positions, cos, sin, caches[0], caches[1], slots, heads, kv_heads)
    ref = qkv.clone()
    kernels._rope_store_kv_torch(ref, positions, cos, sin, caches[2], caches[3], slots, heads)
    # Both round once from float32; fused multiply-adds may flip the last bit.
    _close(ours, ref, ulp)
    _close(caches[0], caches[2], ulp)
    assert torch.equal(caches[1], caches[3])  # v is copied, not rotated
    assert torch.count_nonzero(caches[0].sum(dim=(1, 2))) == tokens


def _reference_attention(q, k_cache, v_cache, table, lens, scale, window):
    rows, width = table.shape
    dim = k_cache.shape[-1]
    pos = torch.arange(width)[None, :]
    mask = pos < lens[:, None]
    if window:
        mask &= pos > lens[:, None] - 1 - window
    k = k_cache[table].float().transpose(1, 2)
    v = v_cache[table].float().transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.float().reshape(rows, -1, 1, dim),
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.reshape(rows, -1)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [(9, 3, 64), (4, 4, 128), (16, 2, 64), (12, 1, 96), (8, 2, 32), (12, 2, 128)],
)
@pytest.mark.parametrize("window", [None, 37])
def test_paged_decode_attention(dtype, tol, heads, kv_heads, dim, window):
    torch.manual_seed(heads * dim)
    k_cache = torch.randn(5000, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn(5000, kv_heads, dim, dtype=dtype)
    lens = torch.tensor([1, 64, 65, 300, 2000])
    table = torch.zeros(5, 2000, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        table[i, :n] = torch.randperm(4999)[:n] + 1
    fused = torch.randn(5, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = fused[:, : heads * dim]  # a strided view, as the model passes it
    ours = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, dim**-0.5, window)
    assert ours is not None
    ref = _reference_attention(q, k_cache, v_cache, table, lens, dim**-0.5, window)
    _close(ours, ref, tol)


def test_attention_declines_what_it_cannot_serve():
    table = torch.ones(2, 3, dtype=torch.long)
    lens = torch.tensor([3, 2])
    width = native.load().attention_vec_width()
    if width > 1:  # a head_dim that is not a multiple of the vector width
        odd = width + width // 2
        q = torch.randn(2, 4 * odd)
        cache = torch.randn(10, 2, odd)
        assert kernels.paged_decode_attention(q, cache, cache, table, lens, 0.1) is None
    half = torch.randn(2, 4 * 64, dtype=torch.float16)
    cache16 = torch.randn(10, 2, 64, dtype=torch.float16)
    assert kernels.paged_decode_attention(half, cache16, cache16, table, lens, 0.1) is None


def test_library_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLITE_KERNEL_CACHE", str(tmp_path))
    first = native._build(native._compiler())
    assert first.exists() and first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert native._build(native._compiler()) == first
    assert first.stat().st_mtime_ns == mtime  # not rebuilt


def test_a_changed_compiler_changes_the_library_key(tmp_path, monkeypatch):
    """The key names the compiler by its file (not by running it): replacing or upgrading the
    compiler must still give a new library, and the same compiler the same one."""
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\nexec gcc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    first = native._compiler_identity("cc")
    assert native._compiler_identity("cc") == first
    assert str(compiler) in first
    compiler.write_text('#!/bin/sh\nexec gcc -O2 "$@"\n')  # an upgrade: other bytes
    assert native._compiler_identity("cc") != first


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
# k = 576: 18 groups of 32 (pairs of groups, vector and scalar tails); 64: one pair only; 96: an
# odd group count (the float path)
@pytest.mark.parametrize("k", [576, 64, 96])
def test_quantized_gemv(dtype, tol, rows, k):
    from sglite.runtime.model.quantization import quantize_int4
    from sglite.runtime.model.quantized_weight import Int4Weight, Int8Weight

    torch.manual_seed(rows)
    w = torch.randn(200, k)
    x = torch.randn(rows, k).to(dtype)
    q8 = Int8Weight(w, dtype)
    dense8 = q8.values.float() * q8.scale[:, None]
    out8 = kernels.int8_gemv(x, q8.values, q8.scale)
    _close(out8, x.float() @ dense8.t(), tol * 8)
    parts = quantize_int4(w)
    q4 = Int4Weight(parts, dtype)
    assert q4.native
    ref4 = x.float() @ parts.dequantize().t()
    # int4 is weight-only: x stays float, so the product is the dequantized weight's.
    _close(kernels.int4_gemv(x, q4.packed, q4.scale_offset).float(), ref4, tol * 8)
    # w4a8 rounds x to int8 per group of 32 (as llama.cpp does) where the CPU has an integer
    # kernel: ~0.5% relative error.
    out4 = kernels.int4_gemv(x, q4.packed, q4.scale_offset, round_activations=True).float()
    assert (out4 - ref4).norm() / ref4.norm() < 1e-2
    _close(kernels.int4_dequantize(q4.packed, q4.scale_offset, dtype), parts.dequantize(), tol)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 20, 200])
def test_q8_0_products_match_gguf_dequantization(rows):
    """GGUF Q8_0 weights (the default model's embedding, used as its output projection) times
    float rows: the GEMV (up to 8 rows, float32 or bf16) and the quantized GEMM compute what
    gguf's own dequantized weights give."""
    import gguf
    import numpy as np

    from sglite.runtime.model.gguf_quants import q8_weight_from_gguf

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((300, 576)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    q8 = q8_weight_from_gguf(blocks, (300, 576))
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    torch.testing.assert_close(q8.dequantize(), dense, atol=0, rtol=0)
    x = torch.randn(rows, 576)
    _close(q8.matmul(x), x @ dense.t(), 1e-4)
    _close(kernels.q8_gemm(x, q8.values, q8.scales), x @ dense.t(), 1e-4)
    if rows <= 8:
        _close(kernels.q8_gemv(x, q8.values, q8.scales), x @ dense.t(), 1e-4)
        xb = x.bfloat16()
        _close(kernels.q8_gemv(xb, q8.values, q8.scales), xb.float() @ dense.t(), 2e-2)
    assert kernels.q8_gemv(x[:, :40], q8.values, q8.scales) is None  # k does not match


def test_quantized_gemv_declines_many_rows():
    from sglite.runtime.model.quantization import quantize_int4
    from sglite.runtime.model.quantized_weight import Int4Weight

    x = torch.randn(9, 64)
    q4 = Int4Weight(quantize_int4(torch.randn(32, 64)), torch.float32)
    assert kernels.int4_gemv(x, q4.packed, q4.scale_offset) is None
    # ...and the weight then multiplies through its dequantized dense form.
    torch.testing.assert_close(
        q4.matmul(x), x @ kernels.int4_dequantize(q4.packed, q4.scale_offset, torch.float32).t()
    )


def test_kernels_are_correct_when_called_from_several_threads():
    """The kernels' thread pool serves one call at a time; concurrent callers must still get
    right answers (a caller that finds the pool busy runs its work on its own thread)."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(5)
    k_cache = torch.randn(3000, 3, 64)
    v_cache = torch.randn(3000, 3, 64)
    table = (torch.arange(8 * 300).reshape(8, 300) % 2999) + 1
    lens = torch.full((8,), 300)
    queries = [torch.randn(8, 9 * 64) for _ in range(16)]
    refs = [_reference_attention(q, k_cache, v_cache, table, lens, 0.125, None) for q in queries]

    def run(i: int) -> torch.Tensor:
        return kernels.paged_decode_attention(queries[i], k_cache, v_cache, table, lens, 0.125)

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(run, range(16)))
    for out, ref in zip(outs, refs, strict=True):
        _close(out, ref, 1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_dense_gemv_matches_matmul(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 200)  # k not a multiple of any vector width: the tails run too
    w = torch.randn(1000, 200)
    out = kernels.dense_gemv(x, w)
    assert out is not None
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    assert kernels.dense_gemv(torch.randn(9, 200), w) is None  # more rows than it serves
    assert kernels.dense_gemv(x.bfloat16(), w.bfloat16()) is None  # float32 only


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_matches_matmul(rows, bias):
    """Every row-tile size and a partial last panel (n_out = 1000 is not a multiple of 16)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 200)
    w = torch.randn(1000, 200)
    b = torch.randn(1000) if bias else None
    panels = kernels.pack_panels(w)
    assert panels is not None and panels.shape[1] == 200
    out = kernels.panel_gemm(x, panels, b, 1000)
    assert out is not None and out.shape == (rows, 1000)
    want = x @ w.T + (b if bias else 0)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, 400)[:, ::2]  # not contiguous: copied, same product
    torch.testing.assert_close(
        kernels.panel_gemm(strided, panels, b, 1000),
        strided @ w.T + (b if bias else 0),
        rtol=1e-5,
        atol=1e-4,
    )


def test_panel_gemm_declines_what_it_cannot_serve():
    w = torch.randn(64, 32)
    panels = kernels.pack_panels(w)
    assert kernels.pack_panels(w.bfloat16()) is None  # float32 only
    assert kernels.panel_gemm(torch.randn(2, 32).bfloat16(), panels, None, 64) is None
    assert kernels.panel_gemm(torch.randn(2, 31), panels, None, 64) is None  # wrong k
    assert kernels.panel_gemm(torch.randn(2, 32), panels, None, 65) is None  # n_out too big
    assert kernels.panel_gemm(torch.randn(2, 32), panels, torch.randn(63), 64) is None


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 50, 130, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_gemm_matches_the_dequantized_matmul(kind, rows, bias):
    """Every dot-tile size (1-3 rows), row blocks, and the panel path for many rows (>= 128),
    with n_out = 83 leaving partial column groups, chunks and panels."""
    from sglite.runtime.model.quantization import quantize_int4
    from sglite.runtime.model.quantized_weight import Int4Weight, Int8Weight

    torch.manual_seed(rows)
    w = torch.randn(83, 96)
    x = torch.randn(rows, 96)
    b = torch.randn(83) if bias else None
    if kind == "int4":
        q = Int4Weight(quantize_int4(w), torch.float32)
        dense = kernels.int4_dequantize(q.packed, q.scale_offset, torch.float32)
        out = kernels.int4_gemm(x, q.packed, q.scale_offset, b)
    else:
        q = Int8Weight(w, torch.float32)
        dense = q.values.float() * q.scale[:, None]
        out = kernels.int8_gemm(x, q.values, q.scale, b)
    assert out is not None and out.shape == (rows, 83)
    want = x @ dense.T
    torch.testing.assert_close(out, want + (b if bias else 0), rtol=1e-5, atol=1e-4)
    # Through the weight's own matmul too. (K = 96 is an odd number of int4 groups, so the AVX2
    # GEMV of rows <= 8 keeps x in float32 rather than rounding it to int8: a tight tolerance.)
    torch.testing.assert_close(q.matmul(x), want, rtol=1e-5, atol=1e-4)


def test_quant_gemm_declines_what_it_cannot_serve():
    from sglite.runtime.model.quantized_weight import Int8Weight

    q = Int8Weight(torch.randn(16, 40), torch.float32)  # k = 40: not whole vectors of 32
    assert kernels.int8_gemm(torch.randn(12, 40), q.values, q.scale) is None
    q = Int8Weight(torch.randn(16, 64), torch.float32)
    assert kernels.int8_gemm(torch.randn(12, 64).bfloat16(), q.values, q.scale) is None
    assert kernels.int8_gemm(torch.randn(12, 32), q.values, q.scale) is None  # wrong k
    assert kernels.int8_gemm(torch.randn(12, 64), q.values, q.scale.half()) is None
    assert kernels.int8_gemm(torch.randn(12, 64), q.values, q.scale, torch.randn(15)) is None
    x = torch.randn(12, 40)  # ...and the weight's matmul still serves them (GEMV in chunks)
    q = Int8Weight(torch.randn(16, 40), torch.float32)
    dense = q.values.float() * q.scale[:, None]
    torch.testing.assert_close(q.matmul(x), x @ dense.T, rtol=1e-5, atol=1e-4)


def test_panels_serve_a_partial_panel_and_fall_back_without_the_library(monkeypatch):
    """n_out = 83 leaves a partial last panel; with the native library gone after packing (as
    when a test switches it off), the same panels are read through PyTorch."""
    from sglite.runtime.model.linear import Linear
    from sglite.runtime.model.linear_weight import PanelWeight

    torch.manual_seed(1)
    layer = Linear(96, 83, bias=True)
    layer.finalize(extra_layouts=True)
    assert isinstance(layer.kernel, PanelWeight)
    xs = [torch.randn(rows, 96) for rows in (1, 7, 300)]
    wants = [x @ layer.weight.detach().T + layer.bias.detach() for x in xs]
    for x, want in zip(xs, wants, strict=True):
        torch.testing.assert_close(layer(x).detach(), want, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(native, "load", lambda: None)
    assert kernels.panel_gemm(xs[0], layer.kernel.panels, None, 83) is None
    for x, want in zip(xs, wants, strict=True):
        torch.testing.assert_close(layer(x).detach(), want, atol=1e-4, rtol=1e-4)
