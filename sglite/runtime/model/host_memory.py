"""The heap policy of a process that runs the model: freed activation memory is kept for reuse.

A prefill allocates activation tensors of tens of megabytes per layer (the 1.5B's MLP output
for a 1000-token chunk is 36 MB). glibc serves blocks above its mmap threshold (32 MB at most)
with fresh mappings, which the kernel zero-fills page by page on first touch and unmaps on free,
so every layer of every step pays those page faults again (a fifth of a 1000-token prefill of
the 1.5B). Serving every block from the heap and trimming it only past a large threshold lets
later layers and steps reuse the pages. Allocators made for this (tcmalloc, jemalloc, which
SGLang's and vLLM's CPU guides preload) do the same; this needs no preload.

glibc's per-thread cache of small freed blocks (tcache) is turned off in that process, through
its environment (`heap_environment`: glibc reads it only at start): a freed small block in the
cache still counts as used, so the small objects PyTorch allocates beside a tensor's data pin a
freed large block away from its neighbours, and PyTorch's 64-byte-aligned requests of the same
size then never fit in it: each 40 MB activation took 40 MB more of fresh heap, seven times
over, before any was reused. Freed at once into the heap's bins, those small blocks merge back.

Invariant: memory a step frees stays in the process (its resident size keeps the largest
step's activations, not the sum of steps); memory mapped explicitly (the GGUF file) is not
affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Free memory the top of the heap keeps before it is returned to the OS.
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Apply the policy to this process (glibc only; elsewhere nothing changes). Returns
    whether it was applied."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


# glibc's tunable for the number of small blocks each thread's cache keeps (0: no cache).
_NO_THREAD_CACHE = "glibc.malloc.tcache_count=0"


def heap_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that runs the model: glibc's thread cache off (see the module
    docstring), added to any `GLIBC_TUNABLES` already there unless they set it themselves."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count" in tunables:
        return dict(env)
    added = f"{tunables}:{_NO_THREAD_CACHE}" if tunables else _NO_THREAD_CACHE
    return {**env, "GLIBC_TUNABLES": added}
