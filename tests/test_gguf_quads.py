"""Q5_0 rows in quads for the int8 GEMV (kernels/gguf_quads.h): the file's bytes in another order,
the int8 product of the file's weight and x rounded as llama.cpp rounds it, each row's own
whatever its batch, every float kernel reading the rows as the file's, the VNNI and tile GEMMs
declining them (the loader's choice on the real 0.5B: tests/test_real_qwen.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_activations import _blocks, _rounded

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_layouts import unquad_q5_0
from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import KERNEL_OFF_ROWS, GGUFWeight

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="needs the native kernels")


def _quads(blocks: np.ndarray, k: int) -> np.ndarray:
    out = np.empty_like(blocks)
    assert kernels.gguf_quad_q5_0(blocks, out, k)
    return out


def _pair(rows: int, k: int, seed: int) -> tuple[np.ndarray, GGUFWeight, GGUFWeight]:
    """Q5_0 blocks of `[rows, k]`, as a weight of the file's rows and as one in quads."""
    blocks = _blocks("Q5_0", rows, k, np.random.default_rng(seed))
    as_file = GGUFWeight([GGUFPart("Q5_0", blocks)], k, round_activations=True)
    quads = GGUFWeight([GGUFPart("Q5_0", _quads(blocks, k), quads=True)], k, round_activations=True)
    return blocks, as_file, quads


def test_quads_move_the_files_bytes_into_the_documented_order():
    """The C layout read back by its definition in numpy is the file's rows byte for byte; a
    quad starts with its four blocks' d, and one value's fifth bit lands where the layout says
    (value 8 l + b of a pair's first block at bit 8 b + 4 + l of the pair's word, of its second
    at bit 8 b + 3 - l)."""
    blocks = _blocks("Q5_0", 3, 256, np.random.default_rng(1))
    quads = _quads(blocks, 256)
    assert quads.shape == blocks.shape and not np.array_equal(quads, blocks)
    assert np.array_equal(unquad_q5_0(quads), blocks)
    in_place = blocks.copy()  # as the weight arena lays them out, piece by piece
    assert kernels.gguf_quad_q5_0(in_place, in_place, 256)
    assert np.array_equal(in_place, quads)
    per_block = blocks.reshape(3, 8, 22)
    assert np.array_equal(quads[2, 88:96].reshape(4, 2), per_block[2, 4:8, :2])  # quad 1's d
    for block, value in ((4, 13), (5, 13), (6, 30)):  # quad 1: blocks 4-7
        one = per_block.copy()
        one[2, 4:8, 2:6] = 0  # quad 1's fifth bits all clear
        one[2, block, 2:6] = np.array([1 << value], "<u4").view(np.uint8)  # only that bit set
        words = _quads(one.reshape(3, -1), 256)[2, 88 + 8 : 88 + 24].view("<u8")
        pair, first = (block - 4) // 2, block % 2 == 0
        lane, b = divmod(value, 8)
        assert words[pair] == 1 << (8 * b + 4 + lane if first else 8 * b + 3 - lane)
        assert words[1 - pair] == 0


@pytest.mark.parametrize("k", [128, 896])
def test_quads_products_are_the_file_weights_times_x_rounded_to_int8(k):
    import gguf

    blocks, as_file, quads = _pair(45, k, k)
    dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_0).reshape(45, k)
    x = np.random.default_rng(7).standard_normal((9, k)).astype(np.float32)
    x[:, 5] *= 30
    want = _rounded(x, 32) @ dense.T.astype(np.float64)
    for rows in (1, 2, 3, 4, 9):
        got = quads.matmul_decode(torch.from_numpy(x[:rows])).numpy()
        assert np.abs(got - want[:rows]).max() <= 1e-5 * np.abs(want).max(), rows
        near = as_file.matmul_decode(torch.from_numpy(x[:rows])).numpy()
        assert np.abs(got - near).max() <= 1e-5 * np.abs(want).max(), rows


def test_a_quads_rows_result_is_the_same_alone_and_in_any_batch():
    _, _, quads = _pair(70, 896, 3)
    x = torch.randn(9, 896)
    alone = torch.cat([quads.matmul_decode(x[i : i + 1]) for i in range(9)])
    for rows in (2, 3, 4, 5, 9):
        assert torch.equal(quads.matmul_decode(x[:rows]), alone[:rows]), rows
    assert torch.equal(quads.matmul_rows(x), alone)


def test_float_kernels_read_quads_rows_as_the_files():
    """The float GEMV (few rows), the quantized GEMM (many) and the dequantizer give the bits
    they give on the file's rows."""
    _, as_file, quads = _pair(64, 384, 5)
    for rows in (1, 3, 4, 17, 40):
        x = torch.randn(rows, 384)
        assert torch.equal(quads.matmul(x), as_file.matmul(x)), rows
    x16 = torch.randn(2, 384).bfloat16()
    assert torch.equal(
        kernels.gguf_gemv(x16, quads.address, 64), kernels.gguf_gemv(x16, as_file.address, 64)
    )
    ids = torch.tensor([63, 0, 17, 17])
    got = kernels.gguf_dequantize(quads.address, 64, 384, torch.float32, ids)
    want = kernels.gguf_dequantize(as_file.address, 64, 384, torch.float32, ids)
    assert torch.equal(got, want)


def test_the_vnni_and_tile_gemms_decline_quads():
    _, _, quads = _pair(32, 256, 9)
    assert quads.a8_gemm_min_rows == KERNEL_OFF_ROWS
    assert quads.amx_min_rows == KERNEL_OFF_ROWS
    x = torch.randn(40, 256)
    assert kernels.gguf_gemm_a8(x, quads.address, 32) is None
    assert kernels.gguf_gemm_amx(x.bfloat16(), quads.address, 32) is None


def test_only_q5_0_rows_of_whole_quads_are_held_in_quads():
    blocks = _blocks("Q5_0", 4, 96, np.random.default_rng(2))
    assert not kernels.gguf_quad_q5_0(blocks, np.empty_like(blocks), 96)
    with pytest.raises(ValueError, match="multiple of 128"):
        GGUFWeight([GGUFPart("Q5_0", blocks, quads=True)], 96)
    q8 = _blocks("Q8_0", 4, 128, np.random.default_rng(2))
    with pytest.raises(ValueError, match="Q8_0"):
        GGUFWeight([GGUFPart("Q8_0", q8, quads=True)], 128)
