"""Fused decoder kernels with PyTorch fallbacks.

Each function runs the native CPU kernel (the C files here, see `native.py`) when the library
is available and every tensor is a CPU float32/bfloat16 tensor in the layout the kernel expects;
otherwise (CUDA, float16, no compiler) it computes the same result with PyTorch ops. Both paths
round to the storage dtype at the same points, so results agree to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglite.runtime.model.kernels import native
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.kernels.gguf_matmul import (  # noqa: F401 (the package's API)
    amx_available,
    bf16_dot_speed_percent,
    bf16_matmul_pays,
    gguf_a8_gemm_min_rows,
    gguf_amx_min_rows,
    gguf_dequantize,
    gguf_gemm,
    gguf_gemm_a8,
    gguf_gemm_a8_glu,
    gguf_gemm_amx,
    gguf_gemm_amx_glu,
    gguf_gemv,
    gguf_gemv_a8,
    gguf_quad_q5_0,
    gguf_quads_pay,
    gguf_tile,
    tile_gemm_available,
    vectors_512_split,
)
from sglite.runtime.model.kernels.matmul import (  # noqa: F401 (the package's API)
    dense_gemv,
    pack_panels,
    panel_gemm,
    qgemv_max_rows,
)
from sglite.runtime.model.kernels.native import DTYPE_CODES as _DTYPE_CODES
from sglite.runtime.model.kernels.native import lib_for as _lib_for
from sglite.runtime.model.kernels.quant_matmul import (  # noqa: F401 (the package's API)
    int4_dequantize,
    int4_gemm,
    int4_gemv,
    int8_gemm,
    int8_gemv,
    q8_gemm,
    q8_gemv,
)


def native_available() -> bool:
    """Whether the native CPU kernels are built and enabled in this process."""
    return native.load() is not None


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`residual += x` in place (skipped when `x` is None); returns `rms_norm(residual) * weight`.

    `residual` and `x` are `[rows, dim]` and contiguous; the result is a new tensor.
    """
    lib = _lib_for(residual, weight) if x is None else _lib_for(residual, weight, x)
    if lib is None or not residual.is_contiguous() or (x is not None and not x.is_contiguous()):
        if x is not None:
            residual.add_(x)
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
    out = torch.empty_like(residual)
    rows, dim = residual.shape
    lib.add_rms_norm(
        _DTYPE_CODES[residual.dtype],
        None if x is None else x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out


# ModelConfig.hidden_act -> the kernels' activation code (kernels.h).
ACTIVATION_CODES = {
    "silu": ABI.constants["ACT_SILU"],
    "gelu_tanh": ABI.constants["ACT_GELU_TANH"],
}


def gated_act(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """`act(gate) * up` for `gate_up = [gate | up]` of shape `[rows, 2 * inter]`; `act` is
    silu (SwiGLU) or gelu_tanh (GeGLU: GELU with the tanh approximation)."""
    rows, width = gate_up.shape
    inter = width // 2
    lib = _lib_for(gate_up)
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.split(inter, dim=-1)
        activated = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
        return activated * up
    out = gate_up.new_empty(rows, inter)
    code = _DTYPE_CODES[gate_up.dtype]
    lib.act_mul(
        code,
        ACTIVATION_CODES[act],
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        inter,
        torch.get_num_threads(),
    )
    return out


def head_rms_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> None:
    """RMSNorm of each query head (by `q_weight [head_dim]`) and key head (`k_weight`) of
    `qkv` (`[T, (heads + 2 kv_heads) * head_dim]`) in place; v is untouched."""
    tokens, width = qkv.shape
    head_dim = q_weight.shape[0]
    lib = _lib_for(qkv, q_weight, k_weight)
    if lib is None or not qkv.is_contiguous():
        q_k = qkv[:, : (num_heads + num_kv_heads) * head_dim]
        q = q_k[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
        k = q_k[:, num_heads * head_dim :].view(tokens, num_kv_heads, head_dim)
        q.copy_(F.rms_norm(q, (head_dim,), q_weight, eps))
        k.copy_(F.rms_norm(k, (head_dim,), k_weight, eps))
        return
    lib.head_rms_norm(
        _DTYPE_CODES[qkv.dtype],
        qkv.data_ptr(),
        tokens,
        width,
        num_heads,
        num_kv_heads,
        head_dim,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        eps,
        torch.get_num_threads(),
    )


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`x.max(dim=-1)` (values, indices) of a contiguous float32 CPU `[rows, n]` in one pass on
    the calling thread (no OpenMP wake-up), or None where the native kernel does not apply."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] == 0:
        return None
    lib = _lib_for(x)
    if lib is None:
        return None
    rows, n = x.shape
    values = x.new_empty(rows)
    indices = torch.empty(rows, dtype=torch.long)
    lib.row_max(x.data_ptr(), rows, n, values.data_ptr(), indices.data_ptr())
    return values, indices


def rope_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotate the q and k heads of `qkv` (`[T, (heads + 2 kv_heads) * head_dim]`) in place with
    the rotate-half RoPE at `positions`, then store k and v into the pool at `out_slots`.

    `cos`/`sin` are float32 tables `[max_pos, head_dim // 2]`; caches `[slots, kv_heads, dim]`.
    """
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    lib = _lib_for(qkv, k_cache, v_cache)
    if lib is None or not (qkv.is_contiguous() and k_cache.is_contiguous()):
        _rope_store_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, out_slots, num_heads)
        return
    lib.rope_store_kv(
        _DTYPE_CODES[qkv.dtype],
        qkv.data_ptr(),
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out_slots.data_ptr(),
        torch.get_num_threads(),
    )


def _rope_store_kv_torch(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    num_heads: int,
) -> None:
    tokens = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    q_k = qkv[:, : (num_heads + kv_heads) * head_dim].view(tokens, num_heads + kv_heads, head_dim)
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    half = head_dim // 2
    x1, x2 = q_k[..., :half].float(), q_k[..., half:].float()
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    q_k.copy_(rotated)
    k = q_k[:, num_heads:]
    v = qkv[:, (num_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    k_cache.index_copy_(0, out_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, out_slots, v.to(v_cache.dtype))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor | None:
    """Attention of one query token per row over K/V read through the slot table, no copy.

    `q` is `[rows, heads * head_dim]` (row stride may be larger: a view into fused QKV);
    `table` `[rows, W]` int64 slots (row stride may be larger), `lens` `[rows]` int64 valid
    entries per row; with `window`, only a row's last `window` tokens. A row's context is cut
    into fixed ranges (kernels.h `ATTENTION_SPAN`), so its output does not depend on the batch.
    Returns
    `[rows, heads * head_dim]`, or None when the native kernel cannot serve these tensors (the
    caller then uses its PyTorch path).
    """
    lib = _lib_for(q, k_cache, v_cache)
    if lib is None or q.stride(-1) != 1 or table.stride(-1) != 1 or not lens.is_contiguous():
        return None
    rows = q.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    heads = q.shape[1] // head_dim
    if (
        heads // kv_heads > lib.attention_max_group()
        or heads > lib.attention_max_heads()
        or head_dim > lib.attention_max_head_dim()
        or head_dim % lib.attention_vec_width()
    ):
        return None
    out = q.new_empty(rows, heads * head_dim)
    status = lib.paged_decode_attention(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        head_dim,
        scale,
        window or 0,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


@dataclass
class ExtendLayout:
    """Where the sequences of an EXTEND batch are, for `extend_attention` (built once per
    forward, shared by every layer): all int64 CPU tensors."""

    slots: torch.Tensor  # every listed sequence's slots (prefix + new), concatenated
    slot_offsets: torch.Tensor  # [S] start of each sequence in `slots`
    q_starts: torch.Tensor  # [S] first row of each sequence's new tokens in q / out
    prefix_lens: torch.Tensor  # [S]
    extend_lens: torch.Tensor  # [S]


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: ExtendLayout,
    heads: int,
    scale: float,
    window: int | None,
) -> torch.Tensor | None:
    """Causal attention of each listed sequence's new tokens over its whole context, read from
    the pool (this pass's K/V already stored there).

    `q` is `[T, heads * head_dim]` (row stride may be larger: a view into fused QKV). Returns
    `[T, heads * head_dim]` whose rows of unlisted sequences are left unset, or None when the
    native kernel cannot serve these tensors (bfloat16 with AVX512-BF16 only): the caller then
    uses its PyTorch path.
    """
    lib = _lib_for(q, k_cache, v_cache)
    if lib is None or q.dtype != torch.bfloat16 or q.stride(-1) != 1:
        return None
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        return None
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    out = q.new_empty(q.shape[0], heads * head_dim)
    status = lib.extend_attention(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        layout.slots.data_ptr(),
        layout.slot_offsets.data_ptr(),
        layout.q_starts.data_ptr(),
        layout.prefix_lens.data_ptr(),
        layout.extend_lens.data_ptr(),
        layout.extend_lens.shape[0],
        out.data_ptr(),
        heads,
        kv_heads,
        head_dim,
        scale,
        window or 0,
        torch.get_num_threads(),
    )
    return out if status == 0 else None
