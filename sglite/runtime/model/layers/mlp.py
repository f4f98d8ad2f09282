"""The gated feed-forward block (SwiGLU, GeGLU) with gate and up fused into one projection."""

from __future__ import annotations

import torch
from torch import nn

from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.model.linear import Linear


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; `act` is silu or gelu_tanh (`ModelConfig.hidden_act`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.act = act
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear.fused(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, hidden] -> [T, hidden]`."""
        return self.tp.all_reduce(self.local(x))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output without the tensor-parallel all-reduce (experts sum first)."""
        return self.down_proj(self.gate_up_proj.gated(x, self.act))
