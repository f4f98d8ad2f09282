"""The paged KV token pool: per-layer K and V tensors indexed by slot id, and a slot allocator.

Invariants:
- Slot 0 is reserved as a padding slot (never allocated), so padded gathers are always in range.
- Every other slot is either free (in `free_slots`) or owned by exactly one holder: the radix
  cache or one running request. `num_free + owned_by_cache + owned_by_requests == capacity`.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """Raised when more slots are requested than are free; callers evict or retract first."""


class KVPool:
    """Preallocated K/V storage `[num_slots, kv_heads, head_dim]` per layer plus a free list."""

    def __init__(
        self,
        capacity: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.capacity = capacity
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (capacity + 1, num_kv_heads, head_dim)
        # torch.empty keeps start-up fast (pages are touched on first write); only the padding
        # slot is read before being written, and it must be finite so masked lanes stay NaN-free.
        self.k = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        for tensor in self.k + self.v:
            tensor[0].zero_()
        # Free list as a python list used as a stack: allocation order does not matter for
        # correctness and a stack keeps recently freed (cache-warm) slots in use.
        self._free: list[int] = list(range(capacity, 0, -1))

    @property
    def num_free(self) -> int:
        """Number of slots that can be allocated now."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take `n` free slots. Raises OutOfSlotsError (taking nothing) when fewer are free."""
        if n > len(self._free):
            raise OutOfSlotsError(f"need {n} KV slots, {len(self._free)} free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, slots: list[int]) -> None:
        """Return slots to the free list. The caller must own them."""
        self._free.extend(slots)

    def reset(self) -> None:
        """Mark every slot free (used by a full cache flush when nothing is running)."""
        self._free = list(range(self.capacity, 0, -1))

    def free_slot_set(self) -> set[int]:
        """A copy of the free slots, for invariant checks in tests."""
        return set(self._free)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one token's K and V take across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize
