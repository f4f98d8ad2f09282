"""Attention over the paged KV pool, for EXTEND (prefill) and DECODE batches.

Decode reads each row's K/V straight from the pool through its slot table: on CPU with the
native kernel (`kernels.paged_decode_attention`, nothing copied), elsewhere with a padded gather
and SDPA. Rows that share a long prefix (few-shot, forks, `n > 1`) are grouped so that prefix is
attended once per group with batched matmuls (`decode_attention.py`). EXTEND runs the native
kernel (`kernels.extend_attention`: every sequence in one call, K/V read from the pool) for
bfloat16 on CPUs with AVX512-BF16 but no AMX, else SDPA per sequence over its cached prefix plus
its new tokens (on AMX CPUs oneDNN's flash attention runs on the tiles, faster than the native
kernel's dot products: docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglite.runtime.model import kernels
from sglite.runtime.model.decode_attention import (
    DecodeGroups,
    grouped_decode_attention,
    plan_decode_groups,
)
from sglite.runtime.model.forward_batch import ForwardBatch


@dataclass
class _SeqAttn:
    """Per-sequence EXTEND attention plan, shared by all layers with the same window."""

    seq: int  # index in the batch
    start: int
    end: int
    prefix_len: int
    # None = plain causal; else an [extend_len, seq_len] bool mask, or on CUDA a lower-right
    # CausalBias (a Tensor subclass SDPA dispatches on).
    mask: torch.Tensor | None


def _lower_right_causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The causal mask of `q_len` queries that are the last of `kv_len` keys.

    On CUDA, PyTorch's `causal_lower_right` bias runs flash attention without a mask; on the CPU
    it only materializes this same bool mask, and importing it loads torch._dynamo (a large
    import) in every process, so the CPU builds the mask directly.
    """
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(q_len, kv_len)  # a torch.Tensor subclass
    full = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    return full.tril(kv_len - q_len)


class AttentionPlan:
    """What every layer's attention needs from a batch, derived once per forward.

    Layers with a sliding window need different masks than full-attention layers; plans are
    built per distinct window on first use.
    """

    def __init__(
        self, batch: ForwardBatch, device: torch.device, native_extend: bool = True
    ) -> None:
        self.batch = batch
        self.device = device
        # Whether bf16 EXTEND attention may take the native kernel (the model's choice).
        self.native_extend = native_extend
        self._extend: dict[int | None, list[_SeqAttn]] = {}
        self._decode: dict[int | None, torch.Tensor | None] = {}
        self._groups: DecodeGroups | None | bool = False  # False = not computed yet
        self._lens: torch.Tensor | None = None
        self._extend_layout: kernels.ExtendLayout | None = None

    def extend_layout(self) -> kernels.ExtendLayout:
        """Slots, rows and lengths of the EXTEND sequences not served by the decode path."""
        if self._extend_layout is None:
            b = self.batch
            batched = set(b.decode_seqs or ())
            seqs, starts, start = [], [], 0
            for i, ext in enumerate(b.extend_lens):
                if i not in batched:
                    seqs.append(i)
                    starts.append(start)
                start += ext
            lens = [b.seq_lens[i] for i in seqs]
            offsets = [0]
            for n in lens[:-1]:
                offsets.append(offsets[-1] + n)
            as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
            self._extend_layout = kernels.ExtendLayout(
                slots=torch.cat([b.kv_slots[i].cpu() for i in seqs]) if seqs else as_long([]),
                slot_offsets=as_long(offsets),
                q_starts=as_long(starts),
                prefix_lens=as_long([b.prefix_lens[i] for i in seqs]),
                extend_lens=as_long([b.extend_lens[i] for i in seqs]),
            )
        return self._extend_layout

    def decode_groups(self) -> DecodeGroups | None:
        """Groups of DECODE rows sharing a prefix (computed once per forward), or None."""
        if self._groups is False:
            b = self.batch
            assert b.padded_slots is not None and b.padded_mask is not None
            self._groups = plan_decode_groups(b.padded_slots, b.padded_mask)
        return self._groups  # type: ignore[return-value]

    def decode_lens(self) -> torch.Tensor:
        """`[rows]` int64: valid entries of each row of the padded slot table."""
        if self._lens is None:
            assert self.batch.padded_mask is not None
            self._lens = self.batch.padded_mask.sum(dim=1)
        return self._lens

    def extend(self, window: int | None) -> list[_SeqAttn]:
        """Per-sequence slices and masks for EXTEND attention with the given window."""
        if window not in self._extend:
            plans, start = [], 0
            b = self.batch
            batched = set(b.decode_seqs or ())
            lens = zip(b.prefix_lens, b.extend_lens, b.seq_lens, strict=True)
            for i, (prefix, ext, total) in enumerate(lens):
                if i in batched:  # served by the decode path
                    start += ext
                    continue
                mask: torch.Tensor | None = None
                if b.scattered:  # each token sees the slots up to its own position
                    q_pos = b.positions[start : start + ext][:, None]
                    k_pos = torch.arange(total, device=self.device)[None, :]
                    mask = k_pos <= q_pos
                    if window is not None:
                        mask &= k_pos > q_pos - window
                elif window is None and prefix > 0:
                    # Causal aligned to the end: query j sees keys 0..prefix+j.
                    mask = _lower_right_causal(ext, total, self.device)
                elif window is not None and (prefix > 0 or total > window):
                    q_pos = torch.arange(prefix, total, device=self.device)[:, None]
                    k_pos = torch.arange(total, device=self.device)[None, :]
                    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
                plans.append(_SeqAttn(i, start, start + ext, prefix, mask))
                start += ext
            self._extend[window] = plans
        return self._extend[window]

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """`[B, 1, 1, L]` bool mask for padded DECODE attention, or None when nothing is masked."""
        if window not in self._decode:
            b = self.batch
            lens = b.decode_seq_lens
            windowed = window is not None and max(lens) > window
            if not windowed and min(lens) == max(lens):
                mask = None  # every row is full: skip masking entirely
            else:
                assert b.padded_mask is not None
                mask = b.padded_mask
                if windowed:
                    seq = torch.tensor(lens, device=self.device)[:, None]
                    k_pos = torch.arange(mask.shape[1], device=self.device)[None, :]
                    mask = mask & (k_pos > seq - 1 - window)
                mask = mask[:, None, None, :]
            self._decode[window] = mask
        return self._decode[window]


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """EXTEND rows: `q [T, heads, D]`, this pass's `k`/`v [T, kv_heads, D]` (already in the
    pool). Returns `[T, heads, D]`; rows served by the decode path are left for the caller."""
    batch = plan.batch
    heads, dim = q.shape[1], q.shape[2]
    # The native kernel's layout has each sequence's new tokens at its end (not `scattered`).
    use_native = plan.native_extend and not batch.scattered
    if use_native and q.device.type == "cpu" and q.dtype == torch.bfloat16:
        native = kernels.extend_attention(
            q.flatten(1), k_cache, v_cache, plan.extend_layout(), heads, scale, window
        )
        if native is not None:
            return native.view(q.shape[0], heads, dim)
    seqs = plan.extend(window)
    if batch.decode_rows is None and len(seqs) == 1:
        out = None  # one sequence: its output is the whole result, no copy needed
    else:
        out = q.new_empty(q.shape[0], heads, dim)
    for seq in seqs:
        qi = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
        if seq.prefix_len == 0:
            # Nothing cached: the fresh K/V are exactly what the pool now holds.
            ki, vi = k[seq.start : seq.end], v[seq.start : seq.end]
        else:
            slots = batch.kv_slots[seq.seq]
            ki, vi = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
        ki = ki.transpose(0, 1).unsqueeze(0).to(q.dtype)
        vi = vi.transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qi,
            ki,
            vi,
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        if out is None:
            return o[0].transpose(0, 1)
        out[seq.start : seq.end] = o[0].transpose(0, 1)
    assert out is not None
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """DECODE rows: `q [B, heads * D]` (may be a strided view); returns `[B, heads * D]`."""
    batch = plan.batch
    assert batch.padded_slots is not None
    bsz = q.shape[0]
    dim = k_cache.shape[-1]
    groups = plan.decode_groups() if window is None else None
    if groups is not None:
        qh = q.reshape(bsz, -1, dim)
        out = grouped_decode_attention(qh, k_cache, v_cache, groups, scale)
        return out.reshape(bsz, -1)
    native = kernels.paged_decode_attention(
        q, k_cache, v_cache, batch.padded_slots, plan.decode_lens(), scale, window
    )
    if native is not None:
        return native
    ks = k_cache[batch.padded_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, L, D]
    vs = v_cache[batch.padded_slots].transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.reshape(bsz, -1, 1, dim),  # [B, heads, 1, D]
        ks,
        vs,
        attn_mask=plan.decode_mask(window),
        scale=scale,
        enable_gqa=True,
    )
    return o.reshape(bsz, -1)
