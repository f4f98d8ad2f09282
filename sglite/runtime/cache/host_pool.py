"""The host tier's KV store: preallocated per-layer K/V tensors in host memory and a slot allocator.

It mirrors `KVPool` (one slot per token, page size 1) so a span moves between the device pool and
the host tier with one indexed copy per layer and tensor. On CUDA the tensors are pinned, so the
copies are DMA transfers; on CPU the tier is simply a second, larger store.

With `quantize=True` a token's K and V are kept as int8 with one float32 scale per (token, head)
(symmetric absmax over `head_dim`): about half the bytes of bfloat16, a quarter of float32. It is
lossy: a span loaded back differs from the computed one by at most half a quantization step per
element, so outputs can drift (off by default).

Invariants:
- Every slot in `[0, capacity)` is either free or owned by exactly one tree node's `host_slots`.
- `num_free + used == capacity`.
"""

from __future__ import annotations

import torch

from sglite.runtime.cache.kv_pool import KVPool

_INT8_MAX = 127.0


class HostKVPool:
    """Host-memory K/V storage `[capacity, kv_heads, head_dim]` per layer plus a free list."""

    def __init__(
        self,
        capacity: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        quantize: bool = False,
        pin_memory: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"host tier capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        self.num_layers = num_layers
        self.dtype = dtype  # of the device pool: what `read` returns
        self.quantize = quantize
        shape = (capacity, num_kv_heads, head_dim)
        store = torch.int8 if quantize else dtype

        def new(shape: tuple[int, ...], kind: torch.dtype) -> torch.Tensor:
            # torch.empty: pages are touched on first write, so a large tier costs nothing idle.
            return torch.empty(shape, dtype=kind, pin_memory=pin_memory)

        self.k = [new(shape, store) for _ in range(num_layers)]
        self.v = [new(shape, store) for _ in range(num_layers)]
        scale_shape = (capacity, num_kv_heads, 1)
        scales = num_layers if quantize else 0
        self.k_scale = [new(scale_shape, torch.float32) for _ in range(scales)]
        self.v_scale = [new(scale_shape, torch.float32) for _ in range(scales)]
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    # ------------------------------------------------------------------ allocation
    @property
    def num_free(self) -> int:
        """Slots that can be allocated now."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Slots owned by tree nodes."""
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free slots, or None (taking nothing) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, slots: list[int]) -> None:
        """Return slots to the free list. The caller must own them."""
        self._free.extend(slots)

    def free_slot_set(self) -> set[int]:
        """A copy of the free slots, for invariant checks."""
        return set(self._free)

    def bytes_per_token(self) -> int:
        """Host bytes one token's K and V take across all layers."""
        per_layer = self.k[0][0].numel() * self.k[0].element_size()
        if self.quantize:
            per_layer += self.k_scale[0][0].numel() * 4
        return 2 * self.num_layers * per_layer

    @staticmethod
    def token_bytes(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, quantize: bool
    ) -> int:
        """`bytes_per_token` before construction (to size the tier from a byte budget)."""
        if quantize:
            return 2 * num_layers * num_kv_heads * (head_dim + 4)
        return KVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    # ------------------------------------------------------------------ data movement
    def save(self, pool: KVPool, device_slots: list[int], host_slots: list[int]) -> None:
        """Copy the K/V of `device_slots` in `pool` into `host_slots` (all layers)."""
        src = torch.tensor(device_slots, dtype=torch.long, device=pool.device)
        dst = torch.tensor(host_slots, dtype=torch.long)
        for layer in range(self.num_layers):
            k = pool.k[layer].index_select(0, src).cpu()
            v = pool.v[layer].index_select(0, src).cpu()
            self._store(layer, dst, k, v)

    def load(self, pool: KVPool, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy `host_slots` into `device_slots` of `pool` (all layers), dequantizing if needed."""
        src = torch.tensor(host_slots, dtype=torch.long)
        dst = torch.tensor(device_slots, dtype=torch.long, device=pool.device)
        for layer in range(self.num_layers):
            k, v = self._fetch(layer, src)
            pool.k[layer].index_copy_(0, dst, k.to(pool.device, non_blocking=True))
            pool.v[layer].index_copy_(0, dst, v.to(pool.device, non_blocking=True))

    def read(self, host_slots: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and V of `host_slots` per layer, in the pool's dtype (for disk pages)."""
        src = torch.tensor(host_slots, dtype=torch.long)
        pairs = [self._fetch(layer, src) for layer in range(self.num_layers)]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def write(self, host_slots: list[int], k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Store per-layer K/V (`[n, heads, head_dim]` each) into `host_slots`."""
        dst = torch.tensor(host_slots, dtype=torch.long)
        for layer in range(self.num_layers):
            self._store(layer, dst, k[layer], v[layer])

    # ------------------------------------------------------------------ internals
    def _store(self, layer: int, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.quantize:
            self.k[layer].index_copy_(0, dst, k.to(self.dtype))
            self.v[layer].index_copy_(0, dst, v.to(self.dtype))
            return
        for values, data, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = _quantize(values)
            data[layer].index_copy_(0, dst, q)
            scales[layer].index_copy_(0, dst, scale)

    def _fetch(self, layer: int, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k[layer].index_select(0, src)
        v = self.v[layer].index_select(0, src)
        if not self.quantize:
            return k, v
        k = (k.float() * self.k_scale[layer].index_select(0, src)).to(self.dtype)
        v = (v.float() * self.v_scale[layer].index_select(0, src)).to(self.dtype)
        return k, v


def _quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (token, head): returns (int8 values, float32 scale per head)."""
    x = values.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / _INT8_MAX
    q = torch.round(x / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale
