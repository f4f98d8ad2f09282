"""Moving cached KV to another position: the keys of a span cached at positions `[p, p + n)`
become the keys it would have at `[p + delta, p + delta + n)`.

Rotate-half RoPE turns a key at position `p` by angle `p * f` per frequency `f`; rotations
compose, so turning a cached key by `delta * f` gives exactly the key at `p + delta` (up to
float rounding) for the same input. Values carry no position and are copied as they are. This is
the first step of reusing a cached document at another place in a prompt: the keys are right for
their new place, though what they attended to when computed (their context) is still the old
one, which only recomputing some of the tokens can repair.

This is model math over the cache's slots: the pool (`cache/kv_pool.py`) only says where a
token's K/V lives, and the RoPE tables (`rope.py`) say how a key turns with its position.

Invariant: the pool's slots are only read at `src` and only written at `dst`; `src` and `dst`
must not overlap.
"""

from __future__ import annotations

import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.rope import RopeSet


def reposition(pool: KVPool, rope: RopeSet, src: list[int], dst: list[int], delta: int) -> None:
    """Copy the K/V of slots `src` into slots `dst`, each layer's keys turned `delta` positions
    further (negative: back) with that layer's RoPE table. ValueError for a table whose angle
    depends on the position range (longrope) or for mismatched slot lists."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destination slots")
    if set(src) & set(dst):
        raise ValueError("source and destination slots overlap")
    if not src:
        return
    src_t = torch.tensor(src, dtype=torch.long, device=pool.device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=pool.device)
    for layer in range(pool.num_layers):
        table = rope.for_layer(layer)
        if table.spec.kind() == "longrope":
            raise ValueError("keys under longrope cannot be moved: its angles depend on position")
        table.ensure(abs(delta) + 1)
        cos, sin = table.cos[abs(delta)], table.sin[abs(delta)]
        if delta < 0:
            sin = -sin  # cos is even, sin odd
        keys = pool.k[layer].index_select(0, src_t)
        pool.k[layer].index_copy_(0, dst_t, rotate_half(keys, cos, sin).to(pool.dtype))
        pool.v[layer].index_copy_(0, dst_t, pool.v[layer].index_select(0, src_t))


def rotate_half(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys `[n, heads, dim]` turned by angles with cosines `cos` and sines `sin` (`[dim // 2]`,
    float32), rotate-half layout (the first half of a head pairs with the second), in float32."""
    x = keys.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
