"""The decoder layers of a DECODE batch run in one native call (`kernels/decode_step.c`).

`NativeDecoder` describes every layer's weights, norms and KV tensors to the C side once (as
ctypes structs holding pointers into the model's own tensors) and then
runs a whole decode step's layers with one call, so per-step Python cost no longer grows with
the layer count. It serves DECODE batches on CPU, in float32 or bfloat16, for every family
whose layers are dense (q/k norms, sandwich norms, SiLU or GELU-tanh, per-layer RoPE tables
included; mixture-of-experts layers run through PyTorch): up to 8 rows with quantized or plain
dense weights, up to 256 with float32 weights in panels (`kernels.panel_gemm`) or quantized
weights and float32 rows (`kernels.int4_gemm`, `kernels.int8_gemm`); anything else (prefill,
larger batches, CUDA, no compiler) goes through the PyTorch path, which computes the same thing.

The model owns its decoder and the decoder refers back to it weakly: a strong reference both ways
made a cycle that kept a discarded model's weights in memory until the next full garbage
collection. The pointers stay valid while the decoder is reachable, i.e. while the model lives.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglite.runtime.model import kernels
from sglite.runtime.model.kernels import native
from sglite.runtime.model.layers.mlp import GatedMLP
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.quantization import Int4Weight, Int8Weight, Q8Weight

if TYPE_CHECKING:
    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.causal_lm import CausalLM
    from sglite.runtime.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

DENSE, INT8, INT4, PANELS, INT4_A8, Q8_0 = 0, 1, 2, 3, 4, 5
# Dense weights that are not in panels go through the native GEMV for at most this many rows
# (its cost grows with the rows; a GEMM wins beyond)...
DENSE_GEMV_MAX_ROWS = 8
# ...and only up to this many when oneDNN-packed weights exist (measured at 8 rows, 1 thread:
# 46 ms/step through PyTorch against 54 ms native).
DENSE_MAX_ROWS = 4


class LinearDesc(ctypes.Structure):
    """`linear_t` of decode_step.c."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("n_out", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class LayerDesc(ctypes.Structure):
    """`layer_t` of decode_step.c."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("rope", ctypes.c_int64),
    ]


def _weight_ptr(norm: nn.Module | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _describe(layer: Linear, quantized: bool) -> LinearDesc | None:
    """The C description of one projection (quantized or dense weight), None if unsupported."""
    bias = layer.bias.data_ptr() if layer.bias is not None else None
    q = layer.quantized
    if quantized and isinstance(q, Int4Weight) and q.native:
        shape = (q.out_features, q.in_features)
        kind = INT4_A8 if q.round_activations else INT4
        return LinearDesc(kind, *shape, q.packed.data_ptr(), q.scale_offset.data_ptr(), bias)
    if quantized and isinstance(q, Int8Weight):
        n, k = q.values.shape
        return LinearDesc(INT8, n, k, q.values.data_ptr(), q.scale.data_ptr(), bias)
    if quantized and isinstance(q, Q8Weight):
        n, k = q.values.shape
        return LinearDesc(Q8_0, n, k, q.values.data_ptr(), q.scales.data_ptr(), bias)
    if quantized and q is not None:
        return None  # a quantized format the C side does not know
    if layer.weight.numel() == 0:
        return None  # dense weight dropped
    n, k = layer.weight.shape
    packed = layer.packed
    if packed is not None and packed.kind == "panels":
        return LinearDesc(PANELS, n, k, packed.data.data_ptr(), None, bias)
    return LinearDesc(DENSE, n, k, layer.weight.data_ptr(), None, bias)


def _quantized_inputs_fit_gemm(model: CausalLM) -> bool:
    """Whether every quantized projection has a multiple of 32 inputs (the quantized GEMM's
    unit; others would make the C step fail past the GEMVs' rows)."""
    projections = (m for m in model.layers.modules() if isinstance(m, Linear))
    return all(p.in_features % 32 == 0 for p in projections if p.quantized is not None)


class NativeDecoder:
    """Runs `CausalLM`'s layers for DECODE batches in C (see module docstring)."""

    def __init__(self, model: CausalLM, lib: ctypes.CDLL) -> None:
        self.model = weakref.proxy(model)
        self.lib = lib
        self.max_rows = int(lib.native_decode_max_rows())
        cfg = model.config
        self.dtype_code = 1 if model.dtype == torch.bfloat16 else 0
        first = model.layers[0].self_attn.qkv_proj
        # Quantized rows: a few in bf16 (the GEMVs), any batch in float32 (past the GEMVs'
        # rows the C side runs the quantized GEMM, which takes whole vectors of 32 inputs).
        self.quantized_rows_limit = int(lib.qgemv_max_rows())
        if self.dtype_code == 0 and _quantized_inputs_fit_gemm(model):
            self.quantized_rows_limit = self.max_rows
        # Calls of at most `quantized_max_rows` rows use the quantized weights, as in Python.
        self.quantized_max_rows = first.quantized_max_rows if first.quantized is not None else 0
        self.tables: dict[bool, ctypes.Array] = {}
        for quantized in (False, True):
            table = self._layer_table(quantized)
            if table is not None:
                self.tables[quantized] = table
        # Dense rows the native step takes: any batch with panels (the same GEMM as PyTorch's
        # path, without its per-operation Python cost), else a few (see DENSE_MAX_ROWS).
        if first.packed is None:
            self.dense_max_rows = DENSE_GEMV_MAX_ROWS
        elif first.packed.kind == "panels":
            self.dense_max_rows = self.max_rows
        else:
            self.dense_max_rows = DENSE_MAX_ROWS
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = model.layers[0].self_attn.scale
        self.act = kernels.ACTIVATION_CODES[cfg.hidden_act]
        self._pool_id: int | None = None

    def _layer_table(self, quantized: bool) -> ctypes.Array | None:
        descs = []
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, GatedMLP):
                return None  # experts: the PyTorch path
            parts = [
                _describe(p, quantized)
                for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if any(p is None for p in parts):
                return None
            descs.append(
                LayerDesc(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    _weight_ptr(layer.attn_output_norm),
                    _weight_ptr(layer.mlp_output_norm),
                    _weight_ptr(attn.q_norm),
                    _weight_ptr(attn.k_norm),
                    *parts,
                    None,
                    None,
                    attn.window or 0,
                    1 if self.model.config.layer_uses_local_rope(i) else 0,
                )
            )
            assert attn.layer_id == i
        return (LayerDesc * len(descs))(*descs)

    @classmethod
    def create(cls, model: CausalLM) -> NativeDecoder | None:
        """A decoder for `model`, or None when the native path cannot serve it."""
        lib = native.load()
        cfg = model.config
        if lib is None or model.device.type != "cpu":
            return None
        if model.dtype not in (torch.float32, torch.bfloat16):
            return None
        group = cfg.num_heads // cfg.num_kv_heads
        if (
            group > lib.attention_max_group()
            or cfg.num_heads > lib.attention_max_heads()
            or cfg.head_dim > lib.attention_max_head_dim()
            or cfg.head_dim % lib.attention_vec_width()
        ):
            return None
        decoder = cls(model, lib)
        return decoder if decoder.tables else None

    def run(self, residual: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> bool:
        """Run every layer over `residual` (`[rows, hidden]`, updated in place) for a DECODE
        batch; False (nothing done) when this batch is not one the native path serves."""
        rows = residual.shape[0]
        if rows > self.max_rows or batch.padded_slots is None:
            return False
        quantized = rows <= self.quantized_max_rows or self.quantized_max_rows < 0
        if quantized and rows > self.quantized_rows_limit:
            return False  # bf16: the quantized GEMVs take a few rows only
        if not quantized and rows > self.dense_max_rows:
            return False  # a GEMM through PyTorch beats the native GEMV from here on
        table = self.tables.get(quantized)
        if table is None:
            return False
        self._attach_pool(pool)
        cfg = self.model.config
        ropes = self.model.ropes
        assert ropes is not None
        rope, local = ropes.tables[0], ropes.tables[-1]
        slots = batch.padded_slots
        lens = batch.positions + 1  # DECODE: each row's new token is its last
        status = self.lib.decode_layers(
            self.dtype_code,
            rows,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            self.act,
            self.eps,
            self.scale,
            len(table),
            table,
            residual.data_ptr(),
            batch.positions.data_ptr(),
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
            local.cos.data_ptr(),
            local.sin.data_ptr(),
            batch.out_slots.data_ptr(),
            slots.data_ptr(),
            slots.stride(0),
            lens.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError("native decode step failed (out of memory?)")
        return True

    def _attach_pool(self, pool: KVPool) -> None:
        if self._pool_id == id(pool):
            return
        for table in self.tables.values():
            for i, desc in enumerate(table):
                desc.k_cache = pool.k[i].data_ptr()
                desc.v_cache = pool.v[i].data_ptr()
        self._pool_id = id(pool)
        self._pool = pool  # keep it alive while its pointers are in the tables


def native_decode_available() -> bool:
    """Whether the native library (and so `NativeDecoder`) can be used in this process."""
    return kernels.native_available()
