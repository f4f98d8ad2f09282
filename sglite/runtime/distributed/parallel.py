"""The tensor-parallel process group and the collectives the model and scheduler use.

One scheduler process per rank; they join a `torch.distributed` group (gloo on CPU, NCCL on
CUDA). Rank 0 runs the scheduler and broadcasts each batch (`broadcast_object`); every rank runs
the same forward, in which row-parallel layers `all_reduce` their partial outputs and the output
projection's vocabulary shards are `all_gather`ed. With `size == 1` every call is a no-op, so
single-process code paths never touch `torch.distributed`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Followers wait in a broadcast while the server is idle; gloo times a collective out after the
# group's timeout, so it must exceed any idle period.
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class TensorParallelGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int

    @property
    def enabled(self) -> bool:
        """Whether there is more than one rank."""
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it."""
        if self.size > 1:
            if x.dtype == torch.bfloat16 and x.device.type == "cpu":
                # gloo sums bf16 in bf16 on some builds; add in float32 like one GEMM would.
                y = x.float()
                dist.all_reduce(y)
                x.copy_(y)
            else:
                dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Concatenate every rank's `x` (`[rows, widths[r]]`) along columns."""
        if self.size == 1:
            return x
        width = max(widths)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


SINGLE = TensorParallelGroup(rank=0, size=1)


def init_tensor_parallel(rank: int, size: int, init_addr: str, device: str) -> TensorParallelGroup:
    """Join the group (`init_addr` is HOST:PORT of rank 0's rendezvous) and return our place."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        world_size=size,
        rank=rank,
        timeout=IDLE_TIMEOUT,
    )
    return TensorParallelGroup(rank=rank, size=size)
