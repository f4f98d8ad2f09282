"""Moving KV between the device pool, the host tier and disk pages, with timing and counters.

`TierIO` does the copies; the tree (`TieredRadixCache`) decides which spans move. Every transfer
into the device pool is timed and fed to the cost model, so the recompute-versus-load decision
follows what this machine actually does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from sglite.runtime.cache.cost_model import TierCostModel
from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.tier_config import TierStats
from sglite.runtime.cache.tree_node import TreeNode

logger = logging.getLogger(__name__)

# (node, lo, hi): tokens [lo, hi) of one node's span.
Segment = tuple[TreeNode, int, int]


class TierIO:
    """Copies between tiers; counts bytes in `stats` and timings in `costs`."""

    def __init__(
        self,
        pool: KVPool,
        host: HostKVPool | None,
        disk: DiskKVStore | None,
        costs: TierCostModel,
        stats: dict[str, TierStats],
    ) -> None:
        self.pool = pool
        self.host = host
        self.disk = disk
        self.costs = costs
        self.stats = stats
        self.device_token_bytes = KVPool.bytes_per_token(
            pool.num_layers, pool.k[0].shape[1], pool.k[0].shape[2], pool.dtype
        )
        self._disk_errors_logged = False

    # ------------------------------------------------------------------ host
    def to_host(self, device_slots: list[int], host_slots: list[int]) -> None:
        """Copy a device span into the host tier (a demotion or a write-through)."""
        assert self.host is not None
        self.host.save(self.pool, device_slots, host_slots)
        nbytes = len(host_slots) * self.host.bytes_per_token()
        self.stats["host"].bytes_in += nbytes
        self.stats["device"].bytes_out += len(device_slots) * self.device_token_bytes
        self.stats["host"].stored_tokens += len(host_slots)

    def from_host(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy a host span into device slots (a promotion), timing it for the cost model."""
        assert self.host is not None
        start = time.perf_counter()
        self.host.load(self.pool, host_slots, device_slots)
        elapsed = time.perf_counter() - start
        nbytes = len(host_slots) * self.host.bytes_per_token()
        self.costs.observe_load("host", nbytes, elapsed)
        self.stats["host"].bytes_out += nbytes
        self.stats["host"].promotions += 1
        self.stats["host"].promoted_tokens += len(host_slots)
        self.stats["device"].bytes_in += len(device_slots) * self.device_token_bytes

    # ------------------------------------------------------------------ gathering
    def gather(self, segments: Sequence[Segment]) -> torch.Tensor:
        """K/V of consecutive spans from whichever tier holds each: `[2, layers, n, heads, dim]`."""
        parts_k: list[list[torch.Tensor]] = []
        parts_v: list[list[torch.Tensor]] = []
        for node, lo, hi in segments:
            if node.slots:
                idx = torch.tensor(node.slots[lo:hi], dtype=torch.long, device=self.pool.device)
                parts_k.append([k.index_select(0, idx).cpu() for k in self.pool.k])
                parts_v.append([v.index_select(0, idx).cpu() for v in self.pool.v])
            else:
                assert self.host is not None and node.host_slots is not None
                k, v = self.host.read(node.host_slots[lo:hi])
                parts_k.append(k)
                parts_v.append(v)
        layers = range(self.pool.num_layers)
        k = torch.stack([torch.cat([p[layer] for p in parts_k]) for layer in layers])
        v = torch.stack([torch.cat([p[layer] for p in parts_v]) for layer in layers])
        return torch.stack([k, v])

    # ------------------------------------------------------------------ disk
    def write_page(self, page_hash: str, tokens: Sequence[int], kv: torch.Tensor) -> bool:
        """Persist one page (`kv` as `gather` returns it); False (logged once) on an I/O error."""
        assert self.disk is not None
        if self.disk.has(page_hash):
            return True
        try:
            written = self.disk.write_page(page_hash, tokens, kv)
        except OSError as exc:
            if not self._disk_errors_logged:
                logger.warning("hicache: cannot write KV pages to disk: %s", exc)
                self._disk_errors_logged = True
            return False
        if written:
            self.stats["disk"].bytes_in += written
            self.stats["disk"].stored_tokens += len(tokens)
        return True

    def load_pages(
        self,
        ids: Sequence[int],
        hashes: Sequence[str],
        first_page: int,
        num_pages: int,
        start: int,
        device_slots: list[int],
    ) -> int:
        """Read pages `first_page ..` into `device_slots`, which hold positions `start ..`.

        Stops at the first missing or corrupt page; returns how many tokens were loaded.
        """
        assert self.disk is not None
        size = self.disk.page_size
        loaded = 0
        nbytes = 0
        t0 = time.perf_counter()
        for k in range(first_page, first_page + num_pages):
            page_start, page_end = k * size, (k + 1) * size
            kv = self.disk.read_page(hashes[k], ids[page_start:page_end])
            if kv is None:
                break
            lo = max(page_start, start) - page_start  # the page may begin inside the match
            dst_slots = device_slots[page_start + lo - start : page_end - start]
            dst = torch.tensor(dst_slots, dtype=torch.long, device=self.pool.device)
            for layer in range(self.pool.num_layers):
                self.pool.k[layer].index_copy_(0, dst, kv[0, layer, lo:].to(self.pool.device))
                self.pool.v[layer].index_copy_(0, dst, kv[1, layer, lo:].to(self.pool.device))
            loaded += len(dst_slots)
            nbytes += self.disk.page_nbytes()
        if loaded:
            self.costs.observe_load("disk", nbytes, time.perf_counter() - t0)
            self.stats["disk"].bytes_out += nbytes
            self.stats["disk"].promotions += 1
            self.stats["disk"].promoted_tokens += loaded
            self.stats["device"].bytes_in += loaded * self.device_token_bytes
        return loaded
