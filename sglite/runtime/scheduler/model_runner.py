"""The model run: one forward pass of a batch over the KV pool.

On tensor-parallel rank 0 each batch is first broadcast to the other ranks, which run the same
forward (`distributed/parallel.py`); they exit when `stop_followers` broadcasts None.
"""

from __future__ import annotations

import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.distributed.parallel import TensorParallelGroup
from sglite.runtime.model.forward_batch import ForwardBatch, RowNarrowing
from sglite.runtime.scheduler.stats import SchedulerStats


class ModelRunner:
    """Runs the scheduler's forward passes (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        tp: TensorParallelGroup,
        device: torch.device,
        stats: SchedulerStats,
    ) -> None:
        self.model = model
        self.pool = pool
        self.tp = tp
        self.device = device
        self.stats = stats

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The logits of `fb.logit_rows` (K/V of every token written into the pool)."""
        self.stats.forward_passes += 1
        if self.tp.enabled:
            self.tp.broadcast_object(fb)
        return self.model(fb, self.pool)

    def forward_narrowing(self, fb: ForwardBatch, narrowing: RowNarrowing) -> torch.Tensor:
        """`CausalLM.forward_narrowing` (a segment assembly's pass; not tensor-parallel)."""
        assert not self.tp.enabled, "followers run only broadcast forwards"
        self.stats.forward_passes += 1
        return self.model.forward_narrowing(fb, self.pool, narrowing)

    def stop_followers(self) -> None:
        """Tell the other tensor-parallel ranks to exit (they wait in a broadcast)."""
        if self.tp.enabled:
            self.tp.broadcast_object(None)
