"""Self-attention with fused QKV, optional per-head q/k norms, RoPE and GQA over the paged pool."""

from __future__ import annotations

import torch
from torch import nn

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.model import kernels
from sglite.runtime.model.attention import AttentionPlan, decode_attention, extend_attention
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.layers.norm import RMSNorm
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.rope import RopeTables


class SelfAttention(nn.Module):
    """One layer's attention: `qkv_proj` (q, k, v stacked), RMSNorm of each q and k head where
    the family has it (`config.qk_norm`), RoPE with the layer's table, K/V written to the pool,
    attention over the layer's window (`config.layer_sliding_window`), then `o_proj`.

    `num_heads`/`num_kv_heads` are this tensor-parallel rank's counts.
    """

    def __init__(
        self, config: ModelConfig, layer_id: int, tp: TensorParallelGroup = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.window = config.layer_sliding_window(layer_id)
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.qkv_proj = Linear.fused(
            config.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        pool: KVPool,
        rope: RopeTables,
    ) -> torch.Tensor:
        """`x` is `[T, hidden]` (normalized); returns the attention output `[T, hidden]`."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            kernels.head_rms_norm(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.num_heads,
                self.num_kv_heads,
                self.q_norm.eps,
            )
        k_cache = pool.k[self.layer_id]
        v_cache = pool.v[self.layer_id]
        kernels.rope_store_kv(
            qkv,
            batch.positions,
            rope.cos,
            rope.sin,
            k_cache,
            v_cache,
            batch.out_slots,
            self.num_heads,
            self.num_kv_heads,
        )
        q = qkv[:, : self.q_size]
        if batch.mode is ForwardMode.DECODE:
            out = decode_attention(q, k_cache, v_cache, plan, self.window, self.scale)
        else:
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            v = qkv[:, self.q_size + self.kv_size :]
            out = extend_attention(
                q.view(t, self.num_heads, self.head_dim),
                k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim),
                k_cache,
                v_cache,
                plan,
                self.window,
                self.scale,
            ).reshape(t, self.q_size)
            if batch.decode_rows is not None:
                rows = batch.decode_rows
                single = decode_attention(
                    q.index_select(0, rows), k_cache, v_cache, plan, self.window, self.scale
                )
                out.index_copy_(0, rows, single)
        return self.tp.all_reduce(self.o_proj(out))
