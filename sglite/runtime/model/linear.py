"""Linear layers: `nn.Linear`'s parameters (so checkpoints, tensor-parallel sharding and the
state dict see a plain layer) computed through one weight object chosen at load time.

Loading fills `weight` (and `bias`); quantizing adds a quantized copy (`set_quantized`);
`finalize` then picks the weight object every call goes through (`linear_weight.select_weight`:
its class names the layout and kernel). Invariant: `forward(x)` computes `x @ weight.T + bias`
(with the quantized copy, to its rounding of the weights), before and after `finalize`.
"""

from __future__ import annotations

import torch
from torch import nn

from sglite.runtime.model import kernels
from sglite.runtime.model.linear_weight import (
    LinearWeight,
    select_weight,
)
from sglite.runtime.model.quantized_weight import QuantizedWeight


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) computed through `self.kernel`.

    With a quantized copy (`set_quantized`), calls of at most `quantized_max_rows` rows use it
    and larger ones the dense weight; with -1 every call uses it and the dense weight is freed.
    """

    quantized: QuantizedWeight | None = None
    quantized_max_rows: int = 0
    _kernel: LinearWeight | None = None
    # The checkpoint projections stacked into this weight, in row order (q/k/v, gate/up): their
    # names beside this module's and their output widths. Empty for an unfused projection.
    part_names: tuple[str, ...] = ()
    part_sizes: tuple[int, ...] = ()

    @classmethod
    def fused(cls, in_features: int, parts: dict[str, int], bias: bool) -> Linear:
        """One projection computing the checkpoint's `parts` (name -> output width) at once."""
        layer = cls(in_features, sum(parts.values()), bias=bias)
        layer.part_names = tuple(parts)
        layer.part_sizes = tuple(parts.values())
        return layer

    def set_quantized(self, weight: QuantizedWeight, max_rows: int) -> None:
        """Serve calls of up to `max_rows` rows (-1: all calls, and the dense weight is freed at
        once) from `weight`; `finalize` must follow before the layout choice takes effect."""
        self.quantized = weight
        self.quantized_max_rows = max_rows
        self._kernel = None
        if max_rows < 0:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def finalize(self, extra_layouts: bool) -> None:
        """Choose the weight object (with `extra_layouts`, the GEMM-friendly copies of the dense
        weight: see `linear_weight.dense_layout`); call once the weights are loaded and
        quantized."""
        self._kernel = select_weight(
            self.weight.data, self.quantized, self.quantized_max_rows, extra_layouts
        )

    @property
    def kernel(self) -> LinearWeight:
        """The weight object calls go through (before `finalize`: the loaded weights as they
        are, chosen per call since loading may still replace them)."""
        if self._kernel is not None:
            return self._kernel
        return select_weight(self.weight.data, self.quantized, self.quantized_max_rows, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, in] -> [T, out]`."""
        return self.kernel.apply(x, self.bias)

    def gated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """`act(gate) * up` of this fused `[gate; up]` projection: `[T, in] -> [T, out / 2]`,
        in one kernel where the weight's layout has one for x (`matmul_gated`)."""
        out = None if self.bias is not None else self.kernel.matmul_gated(x, act)
        return out if out is not None else kernels.gated_act(self(x), act)
