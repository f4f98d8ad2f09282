"""The GGUF blocks read into the process's memory (`model/weight_arena.py`): the same bytes as
the file, in anonymous memory (the file's mapping with `mmap_weights`), the same outputs."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest
import torch
from test_loader import last_logits

from sglite.runtime.model.gguf_index import GGUFFile, open_gguf
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.loader import default_model_path, load_model
from sglite.runtime.model.weight_arena import COLLAPSE_PIECE, HUGE_PAGE, HugePageMove, WeightArena


def mapped_file(address: int) -> str | None:
    """The file whose mapping holds `address` in this process (None: anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    raise AssertionError(f"address {address:#x} is not mapped")


def _gguf_weights(model) -> list[GGUFWeight]:
    found = {id(m.kernel): m.kernel for m in model.modules() if hasattr(m, "kernel")}
    found[id(model.embedding_blocks)] = model.embedding_blocks
    found[id(model.output_projection())] = model.output_projection()
    return [w for w in found.values() if isinstance(w, GGUFWeight)]


@pytest.fixture(scope="module")
def default_gguf() -> GGUFFile:
    return open_gguf(default_model_path())


def _file_bytes(gf: GGUFFile, n: int, offset: int) -> np.ndarray:
    with open(gf.path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(n), dtype=np.uint8)


def test_placed_rows_hold_the_files_bytes(default_gguf):
    """A range of the file's mapping is read from the file, any other array copied; each lands
    4 KB-aligned in anonymous memory."""
    arena = WeightArena.for_file(default_gguf)
    tensor = max(default_gguf.tensors, key=lambda t: t.n_bytes)
    rows = np.asarray(tensor.data).view(np.uint8).reshape(-1, 1024)[5:9000]
    offset = default_gguf.file_offset(rows)
    assert offset is not None and default_gguf.file_offset(rows[:, :512]) is None
    copied = np.arange(3000, dtype=np.uint8).reshape(3, 1000)
    placed, placed_copy = arena.place(rows), arena.place(copied)
    arena.wait()
    assert np.array_equal(placed.reshape(-1), _file_bytes(default_gguf, rows.nbytes, offset))
    assert np.array_equal(placed_copy, copied)
    for array in (placed, placed_copy):
        assert array.ctypes.data % 4096 == 0 and mapped_file(array.ctypes.data) is None
    assert arena.used >= rows.nbytes + copied.nbytes


def test_more_than_the_capacity_is_refused(default_gguf):
    arena = WeightArena(default_gguf, 4096)
    arena.place(np.zeros((2, 2048), dtype=np.uint8))
    with pytest.raises(ValueError, match="do not fit the weight arena"):
        arena.place(np.zeros((1, 1), dtype=np.uint8))
    arena.wait()


def test_a_read_past_the_files_end_is_an_error(tmp_path):
    """`wait` raises what a read met: here the file ends before the bytes asked for."""
    path = tmp_path / "short.bin"
    path.write_bytes(b"0123456789")
    backing = np.zeros((4, 4096), dtype=np.uint8)  # stands for a mapping longer than the file
    gf = GGUFFile(str(path), {}, [], backing.ctypes.data, backing.nbytes)
    arena = WeightArena(gf, 1 << 20)
    arena.place(backing)
    with pytest.raises(OSError, match="ended at byte 10"):
        arena.wait()


def test_huge_pages_keep_the_bytes(default_gguf):
    """Moving the region into 2 MB pages (where the kernel can) changes no byte."""
    arena = WeightArena.for_file(default_gguf)
    tensor = max(default_gguf.tensors, key=lambda t: t.n_bytes)
    rows = np.asarray(tensor.data).view(np.uint8).reshape(1, -1)
    placed = arena.place(rows)
    arena.wait()
    move = arena.huge_page_move()
    if move is not None:
        move.run()
    assert np.array_equal(placed, rows)


def test_weights_in_memory_or_mapped_compute_the_same():
    """The default model's blocks, read into memory (the default) or served from the file's
    mapping (`mmap_weights`): anonymous memory or the file, and the same logits."""
    path = default_model_path()
    read = load_model(path, "float32", progress=False, quantization="auto")
    mapped = load_model(path, "float32", progress=False, quantization="auto", mmap_weights=True)
    held = {}
    for name, loaded in (("read", read), ("mapped", mapped)):
        weights = _gguf_weights(loaded.model)
        assert len(weights) == 4 * 30 + 1  # every layer's projections, the (tied) embedding
        places = [mapped_file(p.data.ctypes.data) for w in weights for p in w.parts]
        held[name] = {where: places.count(where) for where in set(places)}
    parts = 30 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the embedding
    assert held["read"] == {None: parts}
    # llama's q and k rows are stored permuted, held reordered (a copy) either way
    assert held["mapped"] == {os.path.realpath(path): parts - 60, None: 60}
    ids = [1, 504, 3458, 314, 260, 1345, 28]
    assert torch.equal(last_logits(read, ids), last_logits(mapped, ids))


def _aligned_region(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A fresh anonymous mapping and a 2 MB-aligned view of `size` bytes in it, filled."""
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    view = whole[start : start + size]
    view[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    return region, view


def _huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping holding `address` in this process."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1])
    raise AssertionError(f"address {address:#x} is not mapped")


def _collapse_supported() -> bool:
    """Whether this kernel moves anonymous memory into 2 MB pages on request (Linux 6.1+)."""
    region, view = _aligned_region(HUGE_PAGE)
    move = HugePageMove.of([(view.ctypes.data, HUGE_PAGE)])
    supported = move is not None and not move.step() and move.moved == HUGE_PAGE
    del view
    region.close()
    return supported


def test_a_huge_page_move_goes_a_piece_at_a_time():
    """Each step moves one COLLAPSE_PIECE into 2 MB pages, in order, until none is left; the
    bytes stay as they were."""
    if not _collapse_supported():
        pytest.skip("this kernel does not move memory into 2 MB pages (MADV_COLLAPSE)")
    size = 3 * COLLAPSE_PIECE + HUGE_PAGE
    region, view = _aligned_region(size)
    before = view.copy()
    move = HugePageMove.of([(view.ctypes.data, size)])
    assert move is not None and move.pending
    assert move.step() and move.moved == COLLAPSE_PIECE
    assert _huge_kb(view.ctypes.data) >= COLLAPSE_PIECE // 1024
    steps = 1
    while move.step():
        steps += 1
    assert steps + 1 == 4 and move.moved == size and not move.pending
    assert _huge_kb(view.ctypes.data) >= size // 1024
    assert np.array_equal(view, before)
    del view
    region.close()


def test_a_refused_move_ends_and_leaves_the_pages():
    """Memory the kernel cannot move (here: no longer mapped) ends the move at once."""
    region, view = _aligned_region(2 * COLLAPSE_PIECE)
    start = view.ctypes.data
    del view
    region.close()
    move = HugePageMove.of([(start, 2 * COLLAPSE_PIECE)])
    assert move is not None
    assert not move.step() and not move.pending and move.moved == 0


def test_the_server_moves_its_weights_while_idle(engine):
    """Served GGUF blocks (read into the process's memory) move into 2 MB pages in the
    scheduler's idle moments: all of them, soon after a request, reported by get_server_info."""
    if not _collapse_supported():
        pytest.skip("this kernel does not move memory into 2 MB pages (MADV_COLLAPSE)")
    engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    deadline = time.monotonic() + 30
    while (moving := engine.get_server_info()["weights_huge_pages"])["pending"]:
        assert time.monotonic() < deadline, moving
        time.sleep(0.2)
    file_bytes = os.path.getsize(default_model_path())
    assert 0.5 * file_bytes < moving["moved_bytes"] <= file_bytes + HUGE_PAGE * 2
