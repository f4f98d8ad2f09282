"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks `top_k` experts per token and
the token's output is their gated MLPs' outputs weighted by the router's probabilities."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglite.runtime.model import kernels
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.layers.mlp import GatedMLP

# Rows per router GEMV call (the native dense GEMV's row block).
ROUTER_ROWS = 8


class SparseMoE(nn.Module):
    """Routing: softmax over the router's logits (float32), the `top_k` largest, renormalized to
    sum to 1 when `config.norm_topk_prob` (Mixtral always; Qwen3-MoE by its config).

    Invariant: a token's routing does not depend on its batch. The router's logits are computed
    row by row in a fixed order (the native GEMV, whose rows never share a reduction), so prefill,
    decode and any batch choose the same experts for the same hidden state. Experts then run
    grouped: each selected expert multiplies all of its tokens in one call, and a token's
    outputs are summed in expert order.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act)
            for _ in range(config.num_experts)
        )
        self._router_weight: torch.Tensor | None = None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, experts]` float32 logits, each row computed independently of the others."""
        if self._router_weight is None:
            self._router_weight = self.gate.weight.detach().float().contiguous()
        weight = self._router_weight
        x32 = x.float().contiguous()
        chunks = []
        for start in range(0, x32.shape[0], ROUTER_ROWS):
            part = kernels.dense_gemv(x32[start : start + ROUTER_ROWS], weight)
            if part is None:  # no native kernels: PyTorch's GEMM (may round by batch shape)
                return F.linear(x32, weight)
            chunks.append(part)
        return torch.cat(chunks) if len(chunks) != 1 else chunks[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts `[T, top_k]` and their weights (float32)."""
        probs = torch.softmax(self.router_logits(x), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, hidden] -> [T, hidden]`."""
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        chosen_weights = weights.flatten().to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start : start + n]
            rows = tokens[start : start + n]
            start += n
            y = self.experts[expert].local(x.index_select(0, rows))
            out.index_add_(0, rows, y * chosen_weights[picks].unsqueeze(1))
        return out

    def drop_router_cache(self) -> None:
        """Forget the float32 router copy (its source weight changed)."""
        self._router_weight = None
