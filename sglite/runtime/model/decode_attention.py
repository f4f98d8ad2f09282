"""Decode attention that reads a prefix shared by a group of requests once, not once per request.

When requests of a decode batch start with the same KV slots (a few-shot prefix, a fork point,
`n > 1` samples, several system prompts each shared by a group), gathering each request's full
K/V copies that prefix once per request, layer and step, which dominates decode time. Here the
shared part is attended with one batched matmul over a single copy, the per-request suffixes
with a small padded gather, and the two partial softmaxes are merged with their log-sum-exp
(as cascade / split-K attention kernels do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglite.runtime.model import kernels

# Below this many shared tokens the plain padded gather is as cheap.
MIN_SHARED_PREFIX = 32


@dataclass
class SharedPrefixPlan:
    """Slots of the batch-wide common prefix and of each request's own suffix."""

    prefix_slots: torch.Tensor  # [P]
    suffix_slots: torch.Tensor  # [B, S] (pad = slot 0)
    suffix_mask: torch.Tensor  # [B, S] bool


def plan_shared_prefix(
    padded_slots: torch.Tensor, padded_mask: torch.Tensor
) -> SharedPrefixPlan | None:
    """Find the longest prefix of slots common to every row; None when too short to pay."""
    if padded_slots.shape[0] < 2:
        return None
    same = (padded_slots == padded_slots[:1]) & padded_mask
    shared = int(same.all(dim=0).int().cumprod(dim=0).sum())
    if shared < MIN_SHARED_PREFIX:
        return None
    return SharedPrefixPlan(
        prefix_slots=padded_slots[0, :shared],
        suffix_slots=padded_slots[:, shared:],
        suffix_mask=padded_mask[:, shared:],
    )


def shared_prefix_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SharedPrefixPlan,
    scale: float,
) -> torch.Tensor:
    """`q` is `[B, heads, D]`; returns `[B, heads, D]` attention over prefix + own suffix."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    qg = q.view(bsz, kv_heads, group, dim)
    # Shared prefix: one [kv_heads, B*group, D] x [kv_heads, D, P] matmul.
    kp = k_cache.index_select(0, plan.prefix_slots).to(q.dtype)  # [P, kv, D]
    vp = v_cache.index_select(0, plan.prefix_slots).to(q.dtype)
    q_flat = qg.permute(1, 0, 2, 3).reshape(kv_heads, bsz * group, dim)
    sp = torch.bmm(q_flat, kp.permute(1, 2, 0)).float() * scale  # [kv, B*g, P]
    mp = sp.amax(dim=-1, keepdim=True)
    ep = torch.exp(sp - mp)
    lp = ep.sum(dim=-1, keepdim=True)
    op = torch.bmm(ep.to(q.dtype), vp.permute(1, 0, 2)).float()  # [kv, B*g, D]
    op = op.view(kv_heads, bsz, group, dim).permute(1, 0, 2, 3)
    mp = mp.view(kv_heads, bsz, group, 1).permute(1, 0, 2, 3)
    lp = lp.view(kv_heads, bsz, group, 1).permute(1, 0, 2, 3)
    if plan.suffix_slots.shape[1] == 0:
        return (op / lp).to(q.dtype).reshape(bsz, heads, dim)
    # Own suffixes: padded gather of the few tokens after the prefix.
    ks = k_cache[plan.suffix_slots].to(q.dtype).permute(0, 2, 3, 1)  # [B, kv, D, S]
    vs = v_cache[plan.suffix_slots].to(q.dtype).permute(0, 2, 1, 3)  # [B, kv, S, D]
    ss = torch.matmul(qg, ks).float() * scale  # [B, kv, g, S]
    ss = ss.masked_fill(~plan.suffix_mask[:, None, None, :], float("-inf"))
    ms = ss.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    es = torch.exp(ss - ms)
    ls = es.sum(dim=-1, keepdim=True)
    os_ = torch.matmul(es.to(q.dtype), vs).float()  # [B, kv, g, D]
    # Merge the two partial softmaxes.
    m = torch.maximum(mp, ms)
    wp, ws = torch.exp(mp - m), torch.exp(ms - m)
    out = (op * wp + os_ * ws) / (lp * wp + ls * ws)
    return out.to(q.dtype).reshape(bsz, heads, dim)


@dataclass
class DecodeGroups:
    """The batch split into groups sharing a prefix, plus the rows that share nothing."""

    shared: list[tuple[torch.Tensor, SharedPrefixPlan]]  # (row indices, plan)
    plain_rows: torch.Tensor  # [R] rows attended with a plain padded gather
    plain_slots: torch.Tensor  # [R, W]
    plain_mask: torch.Tensor  # [R, W]


def plan_decode_groups(
    padded_slots: torch.Tensor, padded_mask: torch.Tensor
) -> DecodeGroups | None:
    """Group rows by their first slot (rows sharing a cached prefix share it) and plan each group.

    Returns None when no group has a long enough common prefix (the plain path is then best).
    """
    if padded_slots.shape[0] < 2:
        return None
    _, inverse = torch.unique(padded_slots[:, 0], return_inverse=True)
    shared: list[tuple[torch.Tensor, SharedPrefixPlan]] = []
    plain: list[torch.Tensor] = []
    for group in range(int(inverse.max()) + 1):
        rows = (inverse == group).nonzero().flatten()
        width = int(padded_mask[rows].sum(dim=1).max())
        plan = plan_shared_prefix(padded_slots[rows, :width], padded_mask[rows, :width])
        if plan is None:
            plain.append(rows)
        else:
            shared.append((rows, plan))
    if not shared:
        return None
    plain_rows = torch.cat(plain) if plain else padded_slots.new_zeros(0)
    width = int(padded_mask[plain_rows].sum(dim=1).max()) if plain else 0
    return DecodeGroups(
        shared=shared,
        plain_rows=plain_rows,
        plain_slots=padded_slots[plain_rows, :width],
        plain_mask=padded_mask[plain_rows, :width],
    )


def grouped_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: DecodeGroups,
    scale: float,
) -> torch.Tensor:
    """`q` is `[B, heads, D]`; each shared group reads its prefix once, the rest gather."""
    out = torch.empty_like(q)
    for rows, plan in groups.shared:
        out[rows] = shared_prefix_decode_attention(q[rows], k_cache, v_cache, plan, scale)
    if groups.plain_rows.numel():
        qp = q[groups.plain_rows]
        lens = groups.plain_mask.sum(dim=1)
        native = kernels.paged_decode_attention(
            qp.reshape(qp.shape[0], -1), k_cache, v_cache, groups.plain_slots, lens, scale
        )
        if native is not None:
            out[groups.plain_rows] = native.view_as(qp)
            return out
        ks = k_cache[groups.plain_slots].transpose(1, 2).to(q.dtype)
        vs = v_cache[groups.plain_slots].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qp.unsqueeze(2),
            ks,
            vs,
            attn_mask=groups.plain_mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[groups.plain_rows] = o.squeeze(2)
    return out
