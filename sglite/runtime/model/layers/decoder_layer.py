"""One transformer block: attention then MLP (dense or experts), each added to the residual."""

from __future__ import annotations

import torch
from torch import nn

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.model import kernels
from sglite.runtime.model.attention import AttentionPlan
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.forward_batch import ForwardBatch
from sglite.runtime.model.layers.mlp import GatedMLP
from sglite.runtime.model.layers.moe import SparseMoE
from sglite.runtime.model.layers.norm import RMSNorm
from sglite.runtime.model.layers.self_attention import SelfAttention
from sglite.runtime.model.rope import RopeTables


class DecoderLayer(nn.Module):
    """Pre-norm block: `input_layernorm` before attention, `post_attention_layernorm` before the
    MLP (Llama's names), and with `config.sandwich_norms` (Gemma 3) `attn_output_norm` and
    `mlp_output_norm` on the two outputs before they join the residual stream."""

    def __init__(
        self, config: ModelConfig, layer_id: int, tp: TensorParallelGroup = SINGLE
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = SelfAttention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.mlp: GatedMLP | SparseMoE
        if config.layer_is_moe(layer_id):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = GatedMLP(
                size, config.intermediate_size, config.hidden_act, config.mlp_bias, tp
            )
        sandwich = config.sandwich_norms
        self.attn_output_norm = RMSNorm(size, eps) if sandwich else None
        self.mlp_output_norm = RMSNorm(size, eps) if sandwich else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        pool: KVPool,
        rope: RopeTables,
    ) -> torch.Tensor:
        """`x` is `input_layernorm(residual)`. Adds the attention output to `residual` in place
        and returns the MLP output, which the caller adds (fused with the next norm)."""
        attn = self.self_attn(x, batch, plan, pool, rope)
        if self.attn_output_norm is not None:
            attn = self.attn_output_norm(attn)
        norm = self.post_attention_layernorm
        out = self.mlp(kernels.add_rms_norm(attn, residual, norm.weight, norm.eps))
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        return out
