"""Tensor-parallel sharding of a decoder: which heads, MLP columns and vocabulary rows a rank
owns, and how a checkpoint tensor is cut to that rank's part.

Layout (Megatron style): Q/K/V and gate/up are column-parallel (a rank computes its own heads and
its slice of the intermediate dimension), `o_proj` and `down_proj` are row-parallel (each rank
multiplies its input slice; the partial outputs are summed with an all-reduce), the embedding
and the (tied or not) output projection are split by vocabulary rows.

Heads are split by kv-head groups so every rank keeps grouped-query attention uniform: with
`tp <= kv_heads` rank r owns a contiguous range of kv heads and the query heads that read them
(ranges may differ by one kv head: 3 kv heads on 2 ranks give 2 and 1); with `tp > kv_heads`
each kv head is replicated on `tp / kv_heads` ranks, which split its query heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.quantized_weight import Int4Parts


def _even_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` contiguous ranges covering `total` (sizes differ by <= 1)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TensorParallelPlan:
    """What rank `rank` of `size` owns (ranges are half-open, in heads / columns / rows)."""

    rank: int
    size: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    @classmethod
    def create(cls, config: ModelConfig, rank: int, size: int) -> TensorParallelPlan:
        """The plan for one rank. Raises ValueError when the model cannot be split `size` ways."""
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
        if config.num_experts:
            raise ValueError(
                f"tensor parallelism does not split mixture-of-experts models ({config.arch}); "
                "serve it with tp_size 1 (or data parallelism)"
            )
        kv, heads = config.num_kv_heads, config.num_heads
        group = heads // kv
        if size <= kv:
            kv_range = _even_range(kv, size, rank)
            q_range = (kv_range[0] * group, kv_range[1] * group)
        else:
            replicas = size // kv
            if size % kv or group % replicas:
                raise ValueError(
                    f"cannot split {heads} heads / {kv} kv heads over tp_size {size}: "
                    f"tp_size must divide the kv heads or be a multiple of them that divides "
                    f"the query heads per kv head"
                )
            head = rank // replicas
            per = group // replicas
            kv_range = (head, head + 1)
            start = head * group + (rank % replicas) * per
            q_range = (start, start + per)
        if config.intermediate_size < size or config.vocab_size < size:
            raise ValueError(f"the model is too small for tp_size {size}")
        return cls(
            rank=rank,
            size=size,
            kv_heads=kv_range,
            q_heads=q_range,
            intermediate=_even_range(config.intermediate_size, size, rank),
            vocab=_even_range(config.vocab_size, size, rank),
            head_dim=config.head_dim,
        )

    def vocab_widths(self, vocab_size: int) -> list[int]:
        """Every rank's number of vocabulary rows, in rank order."""
        ranges = [_even_range(vocab_size, self.size, r) for r in range(self.size)]
        return [end - start for start, end in ranges]

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's part: its heads and MLP width (vocabulary stays global)."""
        return dataclasses.replace(
            config,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
        )

    # ---------------------------------------------------------------- cutting tensors
    def _rows(self, part: str) -> tuple[int, int] | None:
        """Row range of a column-parallel tensor (`[out, in]` weights and biases), by HF part."""
        d = self.head_dim
        if part == "q_proj":
            return self.q_heads[0] * d, self.q_heads[1] * d
        if part in ("k_proj", "v_proj"):
            return self.kv_heads[0] * d, self.kv_heads[1] * d
        if part in ("gate_proj", "up_proj"):
            return self.intermediate
        if part in ("embed_tokens", "lm_head"):
            return self.vocab
        return None

    def _columns(self, part: str) -> tuple[int, int] | None:
        """Input-column range of a row-parallel weight, by HF part."""
        d = self.head_dim
        if part == "o_proj":
            return self.q_heads[0] * d, self.q_heads[1] * d
        if part == "down_proj":
            return self.intermediate
        return None

    def weight_ranges(self, name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """This rank's row range and input-column range of the checkpoint weight `name` (None:
        all of them), as `shard` cuts it."""
        part = _part_name(name)
        rows = self._rows(part)
        return rows, None if rows is not None else self._columns(part)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (Hugging Face naming).

        Row-parallel biases are kept on rank 0 only (zeros elsewhere), so the all-reduce of the
        partial outputs adds them once.
        """
        part = _part_name(name)
        rows = self._rows(part)
        if rows is not None:
            return tensor[rows[0] : rows[1]]
        cols = self._columns(part)
        if cols is None:
            return tensor  # norms: replicated
        if name.endswith(".bias"):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor[:, cols[0] : cols[1]]

    def shard_int4(self, name: str, parts: Int4Parts) -> Int4Parts | None:
        """This rank's part of a 4-bit weight, or None when its columns do not fall on group
        boundaries (the caller then requantizes from the dense shard)."""
        part = _part_name(name)
        rows = self._rows(part)
        if rows is not None:
            a, b = rows
            return Int4Parts(
                parts.values[a:b], parts.scale[a:b], parts.offset[a:b], parts.group_size
            )
        cols = self._columns(part)
        if cols is None:
            return parts
        a, b = cols
        gs = parts.group_size
        if a % gs or b % gs:
            return None
        return Int4Parts(
            parts.values[:, a:b],
            parts.scale[:, a // gs : b // gs],
            parts.offset[:, a // gs : b // gs],
            gs,
        )


_PART = re.compile(r"(?:^|\.)([a-z_]+)\.(?:weight|bias)$")


def _part_name(name: str) -> str:
    match = _PART.search(name)
    return match.group(1) if match else name
