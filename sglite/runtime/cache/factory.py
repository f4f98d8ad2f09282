"""Build the radix cache a server's flags ask for: the plain device cache, or the tiered one.

With no tier or adaptive-caching flag the plain `RadixCache` is used, so default behaviour is
exactly the device-only cache.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from sglite.runtime.cache.cost_model import TierCostModel
from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.model_key import model_key
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tier_config import HiCacheConfig
from sglite.runtime.cache.tiered_cache import TieredRadixCache

logger = logging.getLogger(__name__)

GB = 1e9  # --hicache-size is in GB (10^9 bytes)


def hicache_config(args) -> HiCacheConfig | None:
    """The tier settings of `args` (a ServerArgs), or None when the plain cache will do."""
    wants_tiers = args.hicache_size > 0 or args.hicache_dir is not None
    if not wants_tiers and args.radix_eviction_policy == "lru":
        return None
    return HiCacheConfig(
        host_tokens=0,  # sized in build_cache, which knows the bytes per token
        host_quantize=args.hicache_quantize,
        disk_dir=args.hicache_dir,
        page_size=args.hicache_page_size,
        write_policy=args.hicache_write_policy,
        eviction_policy=args.radix_eviction_policy,
        load_policy=args.hicache_load_policy,
    )


def build_cache(args, pool: KVPool, loaded) -> RadixCache:
    """The cache for `pool` under `args`; `loaded` (LoadedModel) names the model for disk keys."""
    config = hicache_config(args)
    if config is None:
        return RadixCache(pool)
    cfg = loaded.config
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    host = None
    if args.hicache_size > 0:
        per_token = HostKVPool.token_bytes(*shape, pool.dtype, args.hicache_quantize)
        tokens = int(args.hicache_size * GB // per_token)
        if tokens < 1:
            raise ValueError(
                f"hicache_size {args.hicache_size} GB holds no token ({per_token} bytes each)"
            )
        pinned = pool.device.type == "cuda"
        host = HostKVPool(tokens, *shape, pool.dtype, args.hicache_quantize, pin_memory=pinned)
    disk = None
    if args.hicache_dir is not None:
        os.makedirs(args.hicache_dir, exist_ok=True)
        key, description = model_key(
            loaded.model_path,
            cfg,
            str(pool.dtype).replace("torch.", ""),
            pool.device.type,
            loaded.weight_format,
            loaded.quantized_max_rows,
            memo_path=os.path.join(args.hicache_dir, "fingerprints.json"),
        )
        disk = DiskKVStore(
            args.hicache_dir, key, args.hicache_page_size, *shape, pool.dtype, description
        )
        logger.info("hicache: disk tier %s (%d pages found)", disk.dir, disk.num_pages)
    device_bytes = KVPool.bytes_per_token(*shape, pool.dtype)
    costs = TierCostModel(
        bytes_per_token={
            "host": host.bytes_per_token() if host is not None else device_bytes,
            "disk": device_bytes,
        }
    )
    if host is not None:
        costs.bandwidth["host"] = measure_host_bandwidth(pool, host)
    return TieredRadixCache(pool, config, host, disk, costs)


def measure_host_bandwidth(pool: KVPool, host: HostKVPool, tokens: int = 64) -> float:
    """Bytes/s of a host -> device copy of `tokens` tokens (best of three), at startup."""
    n = min(tokens, pool.capacity, host.capacity)
    device_slots = list(range(1, n + 1))  # every slot is free at startup: scratch space
    host_slots = host.alloc(n)
    assert host_slots is not None
    try:
        host.save(pool, device_slots, host_slots)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            host.load(pool, host_slots, device_slots)
            if pool.device.type == "cuda":
                torch.cuda.synchronize(pool.device)
            best = min(best, time.perf_counter() - start)
    finally:
        host.free(host_slots)
    return n * host.bytes_per_token() / max(best, 1e-9)
