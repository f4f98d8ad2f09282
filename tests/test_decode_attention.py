"""Shared-prefix decode attention equals plain masked attention over each request's full K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglite.runtime.model.decode_attention import (
    grouped_decode_attention,
    plan_decode_groups,
    plan_shared_prefix,
    shared_prefix_decode_attention,
)


def _batch(prefix_len: int, suffix_lens: list[int]):
    prefix = list(range(1, prefix_len + 1))
    rows = [prefix + list(range(300 + 20 * i, 300 + 20 * i + n)) for i, n in enumerate(suffix_lens)]
    width = max(map(len, rows))
    slots = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        slots[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return slots, mask


# float32: the two formulations sum in different orders (and SDPA's order depends on the
# thread count), so allow a few ulps of the outputs' scale.
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("suffix_lens", [[1, 4, 9, 2], [0, 0, 0], [5, 0]])
def test_matches_plain_attention(dtype, tol, suffix_lens):
    torch.manual_seed(0)
    kv_heads, heads, dim = 3, 9, 64
    k_cache = torch.randn(600, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn(600, kv_heads, dim, dtype=dtype)
    slots, mask = _batch(120, suffix_lens)
    q = torch.randn(len(suffix_lens), heads, dim, dtype=dtype)
    plan = plan_shared_prefix(slots, mask)
    assert plan is not None and plan.prefix_slots.numel() == 120
    out = shared_prefix_decode_attention(q, k_cache, v_cache, plan, dim**-0.5)
    ref = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k_cache[slots].transpose(1, 2),
        v_cache[slots].transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        enable_gqa=True,
    ).squeeze(2)
    assert (out.float() - ref.float()).abs().max().item() < tol


def test_no_plan_without_a_long_common_prefix():
    slots, mask = _batch(8, [3, 4])
    assert plan_shared_prefix(slots, mask) is None
    slots, mask = _batch(100, [3])
    assert plan_shared_prefix(slots, mask) is None  # a single request gains nothing


def test_grouped_batch_matches_plain_attention():
    """Two groups with their own prefixes plus a loner: each row equals plain attention."""
    torch.manual_seed(1)
    kv_heads, heads, dim = 3, 9, 64
    k_cache = torch.randn(900, kv_heads, dim)
    v_cache = torch.randn(900, kv_heads, dim)
    group_a = list(range(1, 81))
    group_b = list(range(100, 160))
    rows = [
        group_a + [500, 501],
        group_b + [510],
        group_a + [520, 521, 522],
        [700, 701, 702],
        group_b + [530, 531, 532, 533],
    ]
    width = max(map(len, rows))
    slots = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        slots[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    q = torch.randn(len(rows), heads, dim)
    groups = plan_decode_groups(slots, mask)
    assert groups is not None and len(groups.shared) == 2
    assert groups.plain_rows.tolist() == [3]
    out = grouped_decode_attention(q, k_cache, v_cache, groups, dim**-0.5)
    ref = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k_cache[slots].transpose(1, 2),
        v_cache[slots].transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        enable_gqa=True,
    ).squeeze(2)
    assert (out - ref).abs().max().item() < 1e-5
