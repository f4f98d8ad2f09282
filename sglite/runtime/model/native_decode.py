"""The decoder layers of a DECODE batch run in one native call (`kernels/decode_step.c`).

`NativeDecoder` describes every layer's weights, norms and KV tensors to the C side once (as ctypes
structs holding pointers into the model's own tensors) and then runs a whole decode step's layers
with one call, so per-step Python cost does not grow with the layer count. It serves DECODE batches
on CPU, in float32 or bfloat16, for every family whose layers are dense (q/k norms, sandwich norms,
SiLU or GELU-tanh, per-layer RoPE tables included; mixture-of-experts layers run through PyTorch):
up to 8 rows with quantized or plain dense weights, up to 256 with float32 weights in panels
(`kernels.panel_gemm`) or quantized weights and float32 rows (`kernels.int4_gemm`,
`kernels.int8_gemm`); anything else (prefill, larger batches, CUDA, no compiler) goes through the
PyTorch path, which computes the same thing.

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
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.layers.mlp import GatedMLP
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.linear_weight import LinearWeight, RowSplitWeight

if TYPE_CHECKING:
    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.causal_lm import CausalLM
    from sglite.runtime.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

LayerDesc = ABI.structs["layer_t"]
NATIVE_MAX_ROWS = ABI.constants["NATIVE_MAX_ROWS"]


def _weight_ptr(norm: nn.Module | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _variant(layer: Linear, small: bool) -> LinearWeight:
    """The weight a layer computes small (`small`) or large batches with."""
    weight = layer.kernel
    if isinstance(weight, RowSplitWeight):
        return weight.small if small else weight.large
    return weight


def _split_rows(model: CausalLM) -> int | None:
    """The row count up to which split layers use their quantized weight (None: no layer is
    split, every batch size uses the same weights)."""
    for module in model.layers.modules():
        if isinstance(module, Linear) and isinstance(module.kernel, RowSplitWeight):
            return module.kernel.max_rows
    return None


class NativeDecoder:
    """Runs `CausalLM`'s layers for DECODE batches in C (see module docstring)."""

    def __init__(self, model: CausalLM, lib: ctypes.CDLL) -> None:
        self.model = weakref.proxy(model)
        self.lib = lib
        self.dtype_code = 1 if model.dtype == torch.bfloat16 else 0
        # Split layers: batches of up to `split_rows` rows use the small-batch table.
        self.split_rows = _split_rows(model)
        # Per table: the layer descriptions and the most rows the C step takes with them.
        self.tables: dict[bool, tuple[ctypes.Array, int]] = {}
        for small in (True, False) if self.split_rows is not None else (True,):
            table = self._layer_table(small, model.dtype)
            if table is not None:
                self.tables[small] = table
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = model.layers[0].self_attn.scale
        self.act = kernels.ACTIVATION_CODES[model.config.hidden_act]
        self._pool_id: int | None = None
        # Deterministic inference (`CausalLM.enable_deterministic`): see `decode_layers`.
        self.deterministic = False

    def _layer_table(self, small: bool, dtype: torch.dtype) -> tuple[ctypes.Array, int] | None:
        descs = []
        max_rows = NATIVE_MAX_ROWS
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, GatedMLP):
                return None  # experts: the PyTorch path
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            parts = []
            for projection in projections:
                weight = _variant(projection, small)
                parts.append(weight.native_linear(projection.bias))
                max_rows = min(max_rows, weight.native_rows(dtype))
            if any(p is None for p in parts) or max_rows == 0:
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
        return (LayerDesc * len(descs))(*descs), max_rows

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
        small = self.split_rows is None or rows <= self.split_rows
        table, max_rows = self.tables.get(small, (None, 0))
        if table is None or rows > max_rows or batch.padded_slots is None:
            return False  # e.g. bf16 quantized GEMVs past their rows: PyTorch's GEMM wins
        self._run(table, residual, batch.positions, batch.out_slots, batch.padded_slots, pool)
        return True

    @property
    def max_rows(self) -> int:
        """Most rows one call takes with the small-batch table."""
        return self.tables[True][1] if True in self.tables else 0

    def run_rows(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        slot_table: torch.Tensor,
        pool: KVPool,
    ) -> None:
        """Deterministic mode: rows of tokens, each at `positions[i]` of its sequence, whose K/V
        goes to `out_slots[i]` and which attends to `slot_table[i, : positions[i] + 1]` (rows
        of one sequence in order, so a row sees the K/V of the rows before it). At most
        `max_rows` rows; every row's result depends on its own token and context only."""
        table, max_rows = self.tables[True]
        assert self.deterministic and 0 < residual.shape[0] <= max_rows
        self._run(table, residual, positions, out_slots, slot_table, pool)

    def _run(
        self,
        table: ctypes.Array,
        residual: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        slots: torch.Tensor,
        pool: KVPool,
    ) -> None:
        rows = residual.shape[0]
        self._attach_pool(pool)
        cfg = self.model.config
        ropes = self.model.ropes
        assert ropes is not None
        rope, local = ropes.tables[0], ropes.tables[-1]
        lens = positions + 1  # each row's new token is its last
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
            positions.data_ptr(),
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
            local.cos.data_ptr(),
            local.sin.data_ptr(),
            out_slots.data_ptr(),
            slots.data_ptr(),
            slots.stride(0),
            lens.data_ptr(),
            torch.get_num_threads(),
            int(self.deterministic),
        )
        if status != 0:
            raise RuntimeError("native decode step failed (out of memory?)")

    def _attach_pool(self, pool: KVPool) -> None:
        if self._pool_id == id(pool):
            return
        for table, _ in self.tables.values():
            for i, desc in enumerate(table):
                desc.k_cache = pool.k[i].data_ptr()
                desc.v_cache = pool.v[i].data_ptr()
        self._pool_id = id(pool)
        self._pool = pool  # keep it alive while its pointers are in the tables


def native_decode_available() -> bool:
    """Whether the native library (and so `NativeDecoder`) can be used in this process."""
    return kernels.native_available()
