"""Process memory for a GGUF's quantized blocks, read from the file once at load.

Why: a decode step reads every weight byte, and the kernels read anonymous memory faster than
the file's mapping, the more so in 2 MB pages (docs/benchmarks.md): a file's page-cache pages lie
scattered in physical memory, and each 4 KB page costs a TLB entry. So the blocks are read into
one anonymous region, tensor by tensor, byte for byte as the file stores them: `preadv` for a
range of the file (the file's pages stay in the page cache, reclaimable, never in the process's
resident set), a copy for blocks the loader already copied (permuted or column-cut rows). Once
loaded, the region moves into 2 MB pages a piece at a time (`HugePageMove`), which the server's
scheduler does between its steps and while idle, never beside the kernels: a move on another
thread takes a core from the kernels' two and slows the first requests after a start twice as
much (docs/benchmarks.md).

Invariant: `place` returns a C-contiguous array holding exactly its source's bytes (once `wait`
returns; rearranged by its `relayout`, if given), at a 4 KB boundary of the region; the region
lives as long as any array placed in it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sglite.runtime.model.gguf_index import GGUFFile

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 4096
# Reads are queued in pieces of at most this many bytes, so the threads share a large tensor.
READ_PIECE = 16 << 20
# madvise(2)'s MADV_COLLAPSE (Linux 6.1), and how much of a region one call collapses: a piece
# takes ~20 ms where the VM's host has not backed the memory recently (~2 ms where it has), the
# longest a request arriving during it waits.
MADV_COLLAPSE = 25
COLLAPSE_PIECE = 8 << 20


class WeightArena:
    """An anonymous region of `capacity` bytes (virtual until written) that weight blocks of
    the GGUF file `gf` are placed into. Reads from the file run on `threads` threads while the
    caller goes on; `wait` returns once every placed array holds its bytes."""

    def __init__(self, gf: GGUFFile, capacity: int, threads: int = 2) -> None:
        self.gf = gf
        size = capacity + HUGE_PAGE
        self._region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._region, dtype=np.uint8)
        start = (-whole.ctypes.data) % HUGE_PAGE  # huge pages need 2 MB-aligned addresses
        self._free = whole[start : start + capacity]
        self._used = 0
        self._fd = os.open(gf.path, os.O_RDONLY)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="weights")
        self._reads: list[Future[None]] = []
        # An arena dropped before `wait` (a load that failed) still lets its reads end and
        # closes the file.
        self._release = weakref.finalize(self, _release, self._pool, self._fd)

    @classmethod
    def for_file(cls, gf: GGUFFile, threads: int = 2) -> WeightArena:
        """An arena that can hold every tensor of `gf` (each block tensor is placed at most
        once; only the bytes placed become resident)."""
        return cls(gf, os.path.getsize(gf.path) + ALIGN * (len(gf.tensors) + 1), threads)

    @property
    def used(self) -> int:
        """Bytes of the region taken so far (placed arrays and their alignment)."""
        return self._used

    def reserve(self, shape: tuple[int, int]) -> np.ndarray:
        """A uint8 array of `shape` in the region, its bytes not yet written (for blocks the
        loader lays out itself). Raises ValueError when it does not fit."""
        n = shape[0] * shape[1]
        begin = -(-self._used // ALIGN) * ALIGN
        if begin + n > self._free.shape[0]:
            raise ValueError(f"{n} bytes do not fit the weight arena ({self._free.shape[0]})")
        self._used = begin + n
        return self._free[begin : begin + n].reshape(shape)

    def place(
        self,
        rows: np.ndarray,
        relayout: Callable[[np.ndarray], None] | None = None,
        row_multiple: int = 1,
    ) -> np.ndarray:
        """An array in the region that will hold `rows` (uint8, 2D) once `wait` returns: read
        from the file when `rows` is a range of its mapping, else copied now; with `relayout`,
        rearranged in place by it, whole rows at a time (on the reading threads, each piece as
        it is read), a multiple of `row_multiple` rows but for the last piece. Raises
        ValueError when it does not fit."""
        target = self.reserve(rows.shape)
        offset = self.gf.file_offset(rows)
        if offset is None:
            np.copyto(target, rows)
            if relayout is not None:
                relayout(target)
            return target
        row_bytes = rows.shape[1]
        # rows per piece: whole rows (and whole multiples) for `relayout`
        step = max(1, READ_PIECE // row_bytes // row_multiple) * row_multiple
        for first in range(0, rows.shape[0], step):
            piece = target[first : first + step]
            at = offset + first * row_bytes
            self._reads.append(self._pool.submit(_read_piece, self._fd, piece, at, relayout))
        return target

    def wait(self) -> None:
        """Return once every read is done (raising the first read's error, if any); the arena
        takes no more reads after."""
        try:
            for read in self._reads:
                read.result()
        finally:
            self._release()

    def huge_page_move(self) -> HugePageMove | None:
        """The move of the placed bytes into 2 MB pages (`MADV_COLLAPSE`, Linux 6.1 and later:
        the same addresses, so the kernels never notice), not started; None where the system
        cannot. Why not allocate huge pages at once: on a VM, memory the host has not backed
        recently costs seconds per GB to touch in 2 MB pages, which would delay the start; in
        4 KB pages the start pays ~0.5 s per GB."""
        if self._used == 0:
            return None
        return HugePageMove.of([(self._free.ctypes.data, -(-self._used // HUGE_PAGE) * HUGE_PAGE)])


@dataclass
class HugePageMove:
    """Regions of anonymous memory (2 MB-aligned starts) to move into 2 MB pages, one
    COLLAPSE_PIECE at a time, in order. A piece the system refuses (no transparent huge pages,
    a kernel before 6.1) ends the move: the rest stays in 4 KB pages, as correct and a little
    slower to read."""

    madvise: Callable[[int, int, int], int]
    regions: list[tuple[int, int]]  # (start, bytes) left to move
    moved: int = 0  # bytes moved so far

    @classmethod
    def of(cls, regions: list[tuple[int, int]]) -> HugePageMove | None:
        """The move of `regions`; None where the system has no madvise (not Linux)."""
        madvise = _libc_madvise()
        return None if madvise is None else cls(madvise, list(regions))

    @property
    def pending(self) -> bool:
        """Whether some of the regions are left to move."""
        return bool(self.regions)

    def join(self, other: HugePageMove | None) -> HugePageMove:
        """This move followed by `other`'s regions (e.g. a draft model's weights beside the
        target's)."""
        if other is not None:
            self.regions.extend(other.regions)
            other.regions = []
        return self

    def step(self) -> bool:
        """Move the next piece; whether any is left after it."""
        if not self.regions:
            return False
        start, size = self.regions[0]
        piece = min(COLLAPSE_PIECE, size)
        if self.madvise(start, piece, MADV_COLLAPSE):
            logger.debug("weights stay in 4 KB pages from address %#x", start)
            self.regions.clear()
            return False
        self.moved += piece
        if piece == size:
            self.regions.pop(0)
        else:
            self.regions[0] = (start + piece, size - piece)
        return self.pending

    def run(self) -> None:
        """Move every region now."""
        while self.step():
            pass

    def run_in_background(self) -> threading.Thread:
        """`run` on a daemon thread (for a process with no idle moments to move them in)."""
        thread = threading.Thread(target=self.run, name="weights-huge-pages", daemon=True)
        thread.start()
        return thread


def _release(pool: ThreadPoolExecutor, fd: int) -> None:
    pool.shutdown()
    os.close(fd)


def _read_piece(
    fd: int, rows: np.ndarray, offset: int, relayout: Callable[[np.ndarray], None] | None
) -> None:
    """rows = the file's bytes at `offset`, then rearranged by `relayout` (if any)."""
    _read(fd, rows.reshape(-1), offset)
    if relayout is not None:
        relayout(rows)


def _read(fd: int, target: np.ndarray, offset: int) -> None:
    """target = the file's bytes at `offset` (preadv until complete)."""
    view = memoryview(target)
    done = 0
    while done < target.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the weights' file ended at byte {offset + done}")
        done += got


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(addr, length, advice) -> 0 or -1, on Linux; else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
