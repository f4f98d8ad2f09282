"""Helpers for the tiered-cache tests: a tiny pool whose K/V values name their prefix.

Every token's K (and V) is a value derived from the whole prefix it ends, so wherever a span is
copied (host tier, disk page, back to the pool) a test can check that the values that arrive are
the ones computed for exactly that prefix: a wrong or stale copy cannot go unnoticed.
"""

from __future__ import annotations

import hashlib

import torch

from sglite.runtime.cache.cost_model import TierCostModel
from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.tier_config import HiCacheConfig
from sglite.runtime.cache.tiered_cache import TieredRadixCache

LAYERS, HEADS, DIM = 2, 1, 4
MODEL_KEY = "0" * 32


def prefix_value(prefix: list[int]) -> float:
    """A number in [1, 1000) determined by the whole token prefix."""
    digest = hashlib.sha256(repr(prefix).encode()).digest()
    return 1 + int.from_bytes(digest[:4], "little") % 999000 / 1000


def write_kv(pool: KVPool, ids: list[int], slots: list[int], start: int = 0) -> None:
    """'Compute' the K/V of `ids[start:]` into `slots[start:]` (what a prefill would do)."""
    for j in range(start, len(ids)):
        value = prefix_value(ids[: j + 1])
        for layer in range(pool.num_layers):
            pool.k[layer][slots[j]] = value + layer
            pool.v[layer][slots[j]] = -(value + layer)


def assert_kv(pool: KVPool, ids: list[int], slots: list[int], atol: float = 0.0) -> None:
    """The K/V at `slots` are those of the prefixes of `ids` (exactly, or within `atol`)."""
    assert len(slots) <= len(ids)
    for j, slot in enumerate(slots):
        value = prefix_value(ids[: j + 1])
        for layer in range(pool.num_layers):
            k = pool.k[layer][slot]
            v = pool.v[layer][slot]
            assert torch.allclose(k, torch.full_like(k, value + layer), atol=atol, rtol=0), (
                f"position {j}: K {k.flatten()[:2].tolist()} != {value + layer}"
            )
            assert torch.allclose(v, torch.full_like(v, -(value + layer)), atol=atol, rtol=0)


def make_tiered(
    capacity: int = 32,
    host_tokens: int = 0,
    disk_dir: str | None = None,
    page_size: int = 4,
    write_policy: str = "write_back",
    eviction_policy: str = "lru",
    load_policy: str = "always",
    quantize: bool = False,
    model_key: str = MODEL_KEY,
) -> tuple[KVPool, TieredRadixCache]:
    """A tiered cache over a tiny float32 pool, with the tiers asked for."""
    pool = KVPool(capacity, LAYERS, HEADS, DIM, torch.float32)
    host = None
    if host_tokens:
        host = HostKVPool(host_tokens, LAYERS, HEADS, DIM, torch.float32, quantize)
    disk = None
    if disk_dir is not None:
        disk = DiskKVStore(disk_dir, model_key, page_size, LAYERS, HEADS, DIM, torch.float32)
    config = HiCacheConfig(
        host_tokens=host_tokens,
        host_quantize=quantize,
        disk_dir=disk_dir,
        page_size=page_size,
        write_policy=write_policy,
        eviction_policy=eviction_policy,
        load_policy=load_policy,
    )
    per_token = KVPool.bytes_per_token(LAYERS, HEADS, DIM, torch.float32)
    costs = TierCostModel(bytes_per_token={"host": per_token, "disk": per_token})
    return pool, TieredRadixCache(pool, config, host, disk, costs)


def cache_sequence(pool: KVPool, cache: TieredRadixCache, ids: list[int]) -> int:
    """What a request does: take the cached prefix, compute the rest, insert all, free dups.

    Returns how many tokens came from the cache (any tier).
    """
    found = cache.load_prefix(ids)
    cache.lock(found.node)
    matched = len(found.slots)
    own = pool.alloc(len(ids) - matched) if pool.num_free >= len(ids) - matched else None
    if own is None:
        cache.evict(len(ids) - matched - pool.num_free)
        own = pool.alloc(len(ids) - matched)
    slots = found.slots + own
    write_kv(pool, ids, slots, start=matched)
    already = cache.insert(ids, slots)
    pool.free(slots[matched:already])
    cache.unlock(found.node)
    return matched


def conserved(pool: KVPool, cache: TieredRadixCache, held: int = 0) -> None:
    """Invariants hold and every device slot is free, in the tree, or held by the test."""
    cache.check_invariants()
    assert pool.num_free + cache.total_size() + held == pool.capacity
