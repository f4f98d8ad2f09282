"""A request's KV pages as bytes: gathered from one pool, checked, scattered into another.

Layout of a payload for `n` slots: one contiguous tensor `[2, num_layers, n, kv_heads,
head_dim]` (K then V) in the pool's dtype, sent as raw bytes. Both servers must run the same
model with the same KV dtype; the receiver checks the byte count before writing.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import numpy as np
import torch

from sglite.runtime.cache.kv_pool import KVPool


def gather_pages(pool: KVPool, slots: list[int]) -> np.ndarray:
    """The K/V of `slots` as a flat uint8 array (a copy: the slots may be reused at once)."""
    idx = torch.tensor(slots, dtype=torch.long, device=pool.device)
    parts = [k.index_select(0, idx) for k in pool.k] + [v.index_select(0, idx) for v in pool.v]
    return torch.stack(parts).cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def payload_bytes(pool: KVPool, num_slots: int) -> int:
    """The size of a payload for `num_slots` slots of `pool`."""
    shape = pool.k[0].shape
    itemsize = pool.k[0].element_size()
    return 2 * pool.num_layers * num_slots * shape[1] * shape[2] * itemsize


def scatter_pages(pool: KVPool, slots: list[int], payload: Any) -> None:
    """Write a payload (any buffer, `gather_pages`' layout) into `slots` of `pool`; ValueError
    when its size does not match (another model or KV dtype on the other side)."""
    expected = payload_bytes(pool, len(slots))
    with warnings.catch_warnings():  # read-only buffers are fine: the data is copied at once
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else None
    if flat is None or flat.numel() != expected:
        got = 0 if flat is None else flat.numel()
        raise ValueError(f"KV payload of {got} bytes for {len(slots)} slots; expected {expected}")
    shape = pool.k[0].shape
    data = flat.view(pool.dtype).reshape(2, pool.num_layers, len(slots), shape[1], shape[2])
    idx = torch.tensor(slots, dtype=torch.long, device=pool.device)
    for layer in range(pool.num_layers):
        pool.k[layer].index_copy_(0, idx, data[0, layer].to(pool.device))
        pool.v[layer].index_copy_(0, idx, data[1, layer].to(pool.device))


def checksum(payload: Any) -> int:
    """CRC-32 of a payload's bytes."""
    return zlib.crc32(payload)
