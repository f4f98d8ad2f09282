"""GGUF blocks with activations rounded to int8 (`--gguf-activations int8`, auto on x86): the
kernel computes the file's weights times x rounded as llama.cpp rounds it and a row's result
depends on that row alone; DECODE batches round, prefill keeps x for the float GEMMs; in
deterministic mode every product rounds, so answers do not change with batching or with
prefill against decode."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import sglite as sgl
from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.load_options import resolve_gguf_activations
from sglite.runtime.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="needs the native kernels")

# Every block type the kernels read, at a width of whole super-blocks (x rounded per 256) and,
# for the 32-value types, one that is not (x rounded per 32, as for Qwen2.5-0.5B's 896).
CASES = [(t, 512) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")]
CASES += [(t, 96) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]


def _blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of `type_name` for `[rows, k]`: gguf's own quantizer where it has one,
    else random bytes with small finite scales (gguf cannot quantize k-quants)."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    if not type_name.endswith("_K"):
        return gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), kind)
    per, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, k // per, size), dtype=np.uint8)
    scale = np.full((rows, k // per, 1), 2.0**-8, np.float16).view(np.uint8)
    at = 208 if type_name == "Q6_K" else 0  # d's offset
    blocks[:, :, at : at + 2] = scale
    if type_name != "Q6_K":
        blocks[:, :, 2:4] = scale  # dmin
    return blocks.reshape(rows, -1)


def _rounded(x: np.ndarray, span: int) -> np.ndarray:
    """x as the kernel rounds it: per span, round(x * 127 / max|x|) times max|x| / 127."""
    out = np.empty(x.shape, np.float64)
    for s in range(0, x.shape[1], span):
        xs = x[:, s : s + span].astype(np.float32)
        amax = np.abs(xs).max(axis=1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(
            np.float32
        )
        out[:, s : s + span] = np.rint(xs * inv) * (amax / np.float32(127)).astype(np.float64)
    return out


@pytest.mark.parametrize(("type_name", "k"), CASES)
def test_products_are_the_file_weights_times_x_rounded_to_int8(type_name, k):
    import gguf

    rng = np.random.default_rng(k + len(type_name))
    blocks = _blocks(type_name, 40, k, rng)
    dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(40, k)
    weight = GGUFWeight([GGUFPart(type_name, np.ascontiguousarray(blocks))], k)
    x = rng.standard_normal((11, k)).astype(np.float32)
    x[:, 3] *= 30  # an outlier channel, as real activations have
    got = kernels.gguf_gemv_a8(torch.from_numpy(x), weight.address, 40).numpy()
    want = _rounded(x, 256 if k % 256 == 0 else 32) @ dense.T.astype(np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # The rounding is real: the float product differs by far more than float rounding.
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    assert np.abs(exact - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("n_out", [1, 3, 203, 1029])
def test_every_output_row_is_computed_whatever_the_row_count(n_out):
    """The kernel splits the weight rows over threads and reads a thread's rows as interleaved
    streams; row counts that divide into neither (and a product large enough to be split over
    threads) still give every output its own row's product, none skipped or written twice."""
    import gguf

    rng = np.random.default_rng(n_out)
    blocks = _blocks("Q4_K", n_out, 512, rng)
    dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(n_out, 512)
    weight = GGUFWeight([GGUFPart("Q4_K", np.ascontiguousarray(blocks))], 512)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    want = _rounded(x, 256) @ dense.T.astype(np.float64)
    for rows in (1, 5):
        got = kernels.gguf_gemv_a8(torch.from_numpy(x[:rows]), weight.address, n_out).numpy()
        assert np.abs(got - want[:rows]).max() <= 1e-5 * np.abs(want).max(), rows


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0"])
def test_row_independent_products_are_each_rows_own_bit_for_bit(type_name):
    """Asked for row-independent results (deterministic inference), every row of an 11-row
    product is bitwise its product alone; without, several rows may take other sums of the same
    integers (Q4_K with lanes tied to groups where 512-bit operations are split), equal to float
    rounding."""
    rng = np.random.default_rng(11)
    weight = GGUFWeight([GGUFPart(type_name, _blocks(type_name, 48, 1024, rng))], 1024)
    x = torch.from_numpy(rng.standard_normal((11, 1024)).astype(np.float32))
    alone = torch.cat([kernels.gguf_gemv_a8(x[i : i + 1], weight.address, 48) for i in range(11)])
    together = kernels.gguf_gemv_a8(x, weight.address, 48, row_independent=True)
    assert torch.equal(together, alone)
    _assert_near(kernels.gguf_gemv_a8(x, weight.address, 48), alone)


def test_q4_k_rows_in_blocks_of_eight_match_each_row_alone_bit_for_bit():
    """Many x rows take Q4_K weight rows eight at a time on AVX2 (gguf_a8_k4_block.c): a fused
    weight of 21 Q4_K rows (blocks of eight, and rows left over for the per-row path) and 27
    Q6_K rows, with 5 (the per-row path), 8, 16 and 37 x rows (a block's x rows come 16 at a
    time), gives every row its product alone, bit for bit, and the dequantized weight times the
    rounded x."""
    import gguf

    rng = np.random.default_rng(5)
    q4k, q6k = _blocks("Q4_K", 21, 768, rng), _blocks("Q6_K", 27, 768, rng)
    weight = GGUFWeight([GGUFPart("Q4_K", q4k), GGUFPart("Q6_K", q6k)], 768, None, True)
    x = torch.from_numpy(rng.standard_normal((37, 768)).astype(np.float32))
    alone = torch.cat([kernels.gguf_gemv_a8(x[i : i + 1], weight.address, 48) for i in range(37)])
    for rows in (5, 8, 16, 37):
        got = kernels.gguf_gemv_a8(x[:rows], weight.address, 48, row_independent=True)
        assert torch.equal(got, alone[:rows]), rows
    parts = [
        gguf.quants.dequantize(b, gguf.GGMLQuantizationType[t]).reshape(-1, 768)
        for t, b in (("Q4_K", q4k), ("Q6_K", q6k))
    ]
    want = _rounded(x.numpy(), 256) @ np.concatenate(parts).T.astype(np.float64)
    assert np.abs(alone.numpy() - want).max() <= 1e-5 * np.abs(want).max()


def test_a_fused_weight_of_two_types_takes_each_part_in_its_own():
    import gguf

    rng = np.random.default_rng(7)
    q4k, q6k = _blocks("Q4_K", 24, 256, rng), _blocks("Q6_K", 8, 256, rng)
    weight = GGUFWeight([GGUFPart("Q4_K", q4k), GGUFPart("Q6_K", q6k)], 256, None, True)
    x = torch.randn(3, 256)
    parts = [
        gguf.quants.dequantize(b, gguf.GGMLQuantizationType[t]).reshape(-1, 256)
        for t, b in (("Q4_K", q4k), ("Q6_K", q6k))
    ]
    want = _rounded(x.numpy(), 256) @ np.concatenate(parts).T.astype(np.float64)
    got = weight.matmul_decode(x).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_1", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_is_the_same_alone_and_in_any_batch(dtype, type_name):
    """Bit for bit: a row computed alone, in a batch of 3, of 8 and of 37 (a prefill's worth)
    by the row-independent product deterministic inference uses."""
    rng = np.random.default_rng(3)
    weight = GGUFWeight([GGUFPart(type_name, _blocks(type_name, 200, 512, rng))], 512, None, True)
    x = torch.randn(37, 512).to(dtype)
    alone = weight.matmul_rows(x[5:6])
    assert torch.equal(alone, weight.matmul_decode(x[5:6]))
    for rows in (3, 8, 37):
        batch = weight.matmul_rows(x[5 - min(5, rows // 2) :][:rows])
        assert torch.equal(batch[min(5, rows // 2)], alone[0]), rows
    assert alone.dtype == dtype


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to the output dtype's rounding (float32 sums in another order)."""
    step = 2e-5 if got.dtype == torch.float32 else 8e-3
    err = (got.double() - want.double()).abs().max().item()
    assert err <= step * want.double().abs().max().item(), err


def _vnni_gemm_serves() -> bool:
    """Whether this build has gguf_gemm_a8 (AVX512-VNNI)."""
    rng = np.random.default_rng(0)
    weight = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 16, 256, rng))], 256)
    return kernels.gguf_gemm_a8(torch.zeros(1, 256), weight.address, 16) is not None


VNNI_GEMM = _vnni_gemm_serves()


# Fused weights the VNNI GEMM reads: (block type, rows) per part, and k. 576 values are not
# whole super-blocks: x is rounded per 32 values there.
GEMM_WEIGHTS = [
    ([("Q4_K", 48), ("Q6_K", 32)], 512),
    ([("Q4_1", 48), ("Q8_0", 32)], 512),
    ([("Q4_0", 32), ("Q5_0", 16), ("Q5_1", 16), ("Q8_0", 16)], 576),
]


@pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")
@pytest.mark.parametrize("parts_and_k", GEMM_WEIGHTS, ids=lambda w: "+".join(t for t, _ in w[0]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vnni_gemm_is_the_gemvs_product_and_each_row_its_own(dtype, parts_and_k):
    """gguf_gemm_a8 on a fused weight of several block types (blocks of 16 rows in each part):
    the GEMV's rounded product to float rounding for 1, 8 and 37 rows, and a row's result bit
    for bit the same alone and in any batch."""
    spec, k = parts_and_k
    rng = np.random.default_rng(40)
    parts = [GGUFPart(t, _blocks(t, rows, k, rng)) for t, rows in spec]
    n = sum(rows for _, rows in spec)
    weight = GGUFWeight(parts, k, None, True)
    x = torch.randn(37, k).to(dtype)
    x[:, 7] *= 30
    alone = kernels.gguf_gemm_a8(x[5:6].contiguous(), weight.address, n)
    for rows in (1, 8, 37):
        start = 5 if rows == 1 else 0
        batch = kernels.gguf_gemm_a8(x[start : start + rows].contiguous(), weight.address, n)
        assert batch is not None and batch.dtype == dtype
        _assert_near(
            batch, kernels.gguf_gemv_a8(x[start : start + rows].contiguous(), weight.address, n)
        )
        assert torch.equal(batch[5 - start], alone[0]), rows


@pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_vnni_gemms_gated_product_is_the_unfused_ones_bit_for_bit(act):
    """`matmul_gated` on a fused [gate; up] weight rounding activations (Q4_K gate and up halves
    over a Q6_K part, 37 bf16 rows) equals the VNNI GEMM's product followed by `gated_act`, bit
    for bit; a row's result depends on that row alone; below the GEMM's rows, and for halves
    that are not whole blocks of 16 rows, there is no fused form."""
    rng = np.random.default_rng(17)
    inter, k = 48, 512
    parts = [
        GGUFPart("Q4_K", _blocks("Q4_K", inter, k, rng)),
        GGUFPart("Q6_K", _blocks("Q6_K", inter, k, rng)),
    ]
    weight = GGUFWeight(parts, k, None, True)
    x = torch.randn(37, k).to(torch.bfloat16)
    fused = weight.matmul_gated(x, act)
    assert fused is not None and fused.shape == (37, inter)
    assert torch.equal(fused, kernels.gated_act(weight.matmul(x), act))
    end = 5 + weight.a8_gemm_min_rows
    assert torch.equal(weight.matmul_gated(x[5:end].contiguous(), act), fused[5:end])
    below = x[: weight.a8_gemm_min_rows - 1].contiguous()
    assert weight.matmul_gated(below, act) is None  # the caller takes the unfused form
    odd = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 48, 256, rng))], 256, None, True)
    assert odd.matmul_gated(torch.randn(16, 256).to(torch.bfloat16), act) is None  # halves of 24


@pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")
def test_the_vnni_gemm_declines_what_it_cannot_serve_and_q6_k_takes_it_later():
    rng = np.random.default_rng(41)
    x = torch.randn(8, 512)
    q5k = GGUFWeight([GGUFPart("Q5_K", _blocks("Q5_K", 16, 512, rng))], 512)
    ragged = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 24, 512, rng))], 512)
    odd = GGUFWeight([GGUFPart("Q4_1", _blocks("Q4_1", 16, 96, rng))], 96)
    assert kernels.gguf_gemm_a8(x, q5k.address, 16) is None  # a block type it does not read
    assert kernels.gguf_gemm_a8(x, ragged.address, 24) is None  # 24 rows: not blocks of 16
    assert kernels.gguf_gemm_a8(x[:, :96].contiguous(), odd.address, 16) is None  # 3 blocks of 32
    assert odd.a8_gemm_min_rows == ABI.constants["KERNEL_OFF_ROWS"]
    q4k = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 16, 512, rng))], 512)
    q6k = GGUFWeight([GGUFPart("Q6_K", _blocks("Q6_K", 16, 512, rng))], 512)
    split = "_SPLIT" if kernels.vectors_512_split() else ""
    assert q4k.a8_gemm_min_rows == ABI.constants["A8_GEMM_MIN_ROWS" + split]
    q6k_rows = ABI.constants["A8_GEMM_MIN_ROWS_Q6_K" + split]
    assert q6k.a8_gemm_min_rows == q6k_rows > q4k.a8_gemm_min_rows
    # Where 512-bit operations are split, the GEMV reads long k-quant rows as one stream and the
    # GEMM takes them sooner; blocks of 32 later (their GEMV keeps the lead longer there).
    k_long = 256 * (ABI.constants["SHORT_ROW_BYTES"] // 144 + 1)  # Q4_K rows past the bound
    long_q4k = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 16, k_long, rng))], k_long)
    q8 = GGUFWeight([GGUFPart("Q8_0", _blocks("Q8_0", 16, 512, rng))], 512)
    if split:
        assert long_q4k.a8_gemm_min_rows == ABI.constants["A8_GEMM_MIN_ROWS_LONG_SPLIT"]
        assert long_q4k.a8_gemm_min_rows < q4k.a8_gemm_min_rows < q8.a8_gemm_min_rows
        assert q8.a8_gemm_min_rows == ABI.constants["A8_GEMM_MIN_ROWS_B32_SPLIT"]
    else:
        assert long_q4k.a8_gemm_min_rows == q8.a8_gemm_min_rows == q4k.a8_gemm_min_rows


def _cpuinfo_field(name: str) -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    return ""


def test_512_bit_operations_count_as_split_on_amd_zen_4_alone():
    """CPUID's vendor and family, as /proc/cpuinfo names them: AMD family 25 (Zen 3 and Zen 4; only
    Zen 4 has AVX-512) runs 512-bit operations in two halves; Intel and Zen 5 (26) do not."""
    zen4 = _cpuinfo_field("vendor_id") == "AuthenticAMD" and _cpuinfo_field("cpu family") == "25"
    assert kernels.vectors_512_split() == (zen4 and kernels.native_available())


SPLIT_CHECK = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_gguf_activations import _blocks
from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
rng = np.random.default_rng(47)
x = torch.from_numpy(rng.standard_normal((3, 1024)).astype(np.float32))
out = [str(int(kernels.vectors_512_split()))]
for kind in ("Q4_K", "Q6_K", "Q4_1"):
    w = GGUFWeight([GGUFPart(kind, _blocks(kind, 40, 1024, rng))], 1024)
    for rows in (1, 3):
        y = kernels.gguf_gemv_a8(x[:rows].contiguous(), w.address, 40)
        out.append(" ".join(repr(v) for v in y.flatten().tolist()))
print("|".join(out))
"""


def test_the_gemv_computes_the_same_sums_whether_512_bit_operations_are_split_or_not():
    """The int8 GEMV's two x86 layouts (a split CPU's 256-bit k-quant path and one stream of
    rows, or the 512-bit path and two streams), forced by SGLITE_VECTORS_512_SPLIT on any host:
    the same integer sums, so results equal to float rounding of their order."""
    here = os.path.dirname(__file__)
    results = {}
    for setting in ("0", "1"):
        done = subprocess.run(
            [sys.executable, "-c", SPLIT_CHECK, here],
            env={**os.environ, "SGLITE_VECTORS_512_SPLIT": setting},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        flag, *values = done.stdout.strip().splitlines()[-1].split("|")
        assert flag == (setting if kernels.native_available() else "0")
        results[setting] = [torch.tensor([float(v) for v in part.split()]) for part in values]
    for narrow, wide in zip(results["1"], results["0"], strict=True):
        assert torch.allclose(narrow, wide, rtol=1e-5, atol=1e-4), (narrow - wide).abs().max()


@pytest.mark.skipif(not VNNI_GEMM, reason="the build has no 512-bit VNNI GEMM")
def test_without_amx_a_rounding_weight_takes_the_vnni_gemm_before_bf16_dot_products():
    """Where the VNNI GEMM serves a weight that rounds activations, bf16 batches of every size
    take it rather than the tile GEMM's AVX512-BF16 dot products (no AMX); with AMX the tiles
    keep them from `amx_min_rows`. A weight that keeps x keeps the tile threshold."""
    rng = np.random.default_rng(43)
    blocks = _blocks("Q4_K", 32, 512, rng)
    rounding = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, True)
    keeping = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, False)
    off = ABI.constants["KERNEL_OFF_ROWS"]
    assert keeping.amx_min_rows == kernels.gguf_amx_min_rows(keeping.address, 32, 512)
    if kernels.amx_available():
        assert rounding.amx_min_rows == keeping.amx_min_rows < off
        return
    assert rounding.amx_min_rows == off
    x = torch.randn(64, 512).to(torch.bfloat16)
    gemm = kernels.gguf_gemm_a8(x, rounding.address, 32)
    assert torch.equal(rounding.matmul(x), gemm)
    assert torch.equal(rounding.matmul_decode(x), gemm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_products_round_and_prefill_products_round_where_the_vnni_gemm_serves(dtype):
    """A DECODE batch's product (`matmul_decode`) is the int8 kernel's below the weight's
    `amx_min_rows` (and at any row count without the tile GEMM; from `a8_gemm_min_rows` rows the
    VNNI GEMM where the build has it); from there a bf16 batch takes the tile GEMM (AMX or
    AVX512-BF16), as prefill does. An EXTEND pass's (`matmul`) is the same rounded product for a
    bf16 batch where the VNNI GEMM serves the weight, else what the weight without rounding
    computes (float32 always)."""
    rng = np.random.default_rng(5)
    blocks = _blocks("Q4_K", 64, 512, rng)
    rounding = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, True)
    keeping = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, False)
    assert (rounding.a8_gemm_min_rows < ABI.constants["KERNEL_OFF_ROWS"]) == VNNI_GEMM
    for rows in (1, 4, 40):
        x = torch.randn(rows, 512).to(dtype)
        tiles = rounding.amx_min_rows <= rows and kernels.tile_gemm_available()
        many = rows >= rounding.a8_gemm_min_rows
        gemm = kernels.gguf_gemm_a8(x, rounding.address, 64) if many else None
        if dtype == torch.bfloat16 and tiles:
            assert torch.equal(rounding.matmul_decode(x), keeping.matmul(x))
        elif gemm is not None:  # the VNNI GEMM: the same rounded product, summed in its order
            assert torch.equal(rounding.matmul_decode(x), gemm)
            _assert_near(gemm, rounding.matmul_rows(x))
        else:
            assert torch.equal(rounding.matmul_decode(x), rounding.matmul_rows(x))
            assert not torch.equal(rounding.matmul_decode(x), keeping.matmul(x))
        if dtype == torch.bfloat16 and VNNI_GEMM and not tiles:
            assert torch.equal(rounding.matmul(x), rounding.matmul_decode(x))
            assert not torch.equal(rounding.matmul(x), keeping.matmul(x))
        else:
            assert torch.equal(rounding.matmul(x), keeping.matmul(x))
        assert torch.equal(keeping.matmul_decode(x), keeping.matmul(x))


@pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")
def test_float32_prefill_rounds_where_float32_is_dtype_autos_choice():
    """`round_float32_extend` (the loader's for `dtype=auto` resolved to float32, on a CPU
    without bf16): a float32 EXTEND pass's product, and its gated form, are the VNNI GEMM's
    rounded ones, as a DECODE batch's; without it (an explicit float32) x is kept."""
    rng = np.random.default_rng(8)
    blocks = _blocks("Q4_K", 64, 512, rng)
    auto = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, True, round_float32_extend=True)
    asked = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, True)
    keeping = GGUFWeight([GGUFPart("Q4_K", blocks)], 512, None, False)
    x = torch.randn(40, 512)
    gemm = kernels.gguf_gemm_a8(x, auto.address, 64)
    assert torch.equal(auto.matmul(x), gemm) and torch.equal(auto.matmul_decode(x), gemm)
    assert torch.equal(asked.matmul(x), keeping.matmul(x))
    assert not torch.equal(asked.matmul(x), gemm)
    gated = kernels.gguf_gemm_a8_glu(x, auto.address, 64, kernels.ACTIVATION_CODES["silu"])
    assert torch.equal(auto.matmul_gated(x, "silu"), gated)
    assert asked.matmul_gated(x, "silu") is None


@pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")
def test_a_draft_models_float32_prompt_reads_round_x_where_a_target_asked_for_float32_keeps_it():
    """A draft model (`gguf_tiles`) in a target's explicit float32: its EXTEND passes (prompt
    reads, long catch-ups) take the VNNI GEMM on x rounded as its decode does, since its
    products only guess drafts; a target asked for float32 keeps its exact products."""
    from sglite.runtime.model.loader import load_model

    def head(**kwargs) -> GGUFWeight:
        loaded = load_model(
            None, dtype=torch.float32, quantization="auto", progress=False, **kwargs
        )
        weight = loaded.model.output_projection()
        assert isinstance(weight, GGUFWeight)
        return weight

    draft, target = head(gguf_tiles=True, gguf_activations="int8"), head(gguf_activations="int8")
    x = torch.randn(40, draft.in_features)
    rounded = kernels.gguf_gemm_a8(x, draft.address, draft.out_features)
    assert torch.equal(draft.matmul(x), rounded)
    assert not torch.equal(target.matmul(x), rounded)


@pytest.mark.skipif(not VNNI_GEMM, reason="the VNNI GEMM needs an AVX512-VNNI build")
def test_a_weight_the_vnni_gemm_cannot_read_keeps_x_in_extend_passes():
    """Q5_K blocks (no VNNI GEMM for them): the GEMM is off for the weight, and a bf16 EXTEND
    pass's product is the float one, not the int8 GEMV's at prefill sizes."""
    rng = np.random.default_rng(6)
    blocks = _blocks("Q5_K", 32, 512, rng)
    rounding = GGUFWeight([GGUFPart("Q5_K", blocks)], 512, None, True)
    keeping = GGUFWeight([GGUFPart("Q5_K", blocks)], 512, None, False)
    assert rounding.a8_gemm_min_rows == ABI.constants["KERNEL_OFF_ROWS"]
    x = torch.randn(64, 512).to(torch.bfloat16)
    assert torch.equal(rounding.matmul(x), keeping.matmul(x))


def test_auto_rounds_activations_where_the_kernels_have_integer_dot_products():
    assert resolve_gguf_activations("auto", ["avx2_fma", "f16c"]) == "int8"
    assert resolve_gguf_activations("auto", ["avx2_fma", "avx512", "avx512_vnni"]) == "int8"
    assert resolve_gguf_activations("auto", ["neon"]) == "float"
    assert resolve_gguf_activations("auto", []) == "float"
    assert resolve_gguf_activations("float", ["avx2_fma"]) == "float"
    assert resolve_gguf_activations("int8", []) == "int8"
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        resolve_gguf_activations("int4")
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        ServerArgs(gguf_activations="fp8").validate()


@pytest.fixture(scope="module")
def int8_engine():
    """The default model (Q4_1 projections, Q8_0 embedding and head) rounding activations in
    deterministic mode (every product through the int8 kernel), the radix cache off so that a
    prompt is always prefilled."""
    engine = sgl.Engine(
        gguf_activations="int8", disable_radix_cache=True, enable_deterministic_inference=True
    )
    yield engine
    engine.shutdown()


def test_the_default_engine_rounds_decode_activations_where_it_can():
    from sglite.runtime.model.kernels import native

    with sgl.Engine(log_level="error") as engine:
        info = engine.get_server_info()
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, **GREEDY})
    assert info["activations"] == ("int8" if "avx2_fma" in native.isa() else "float")
    assert "Paris" in out["text"]


def test_the_engine_reports_the_path_it_took(int8_engine):
    info = int8_engine.get_server_info()
    assert info["activations"] == "int8"
    assert info["quantization"] != "none"


def test_answers_do_not_change_with_batching_or_prefill_against_decode(int8_engine):
    from sglite.runtime.model.loader import load_tokenizer

    ids = load_tokenizer().encode("List three colors of the rainbow:")
    alone = int8_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY})
    others = [load_tokenizer().encode(p) for p in ("Say hi.", "Count to five:", "Name a fruit.")]
    batch = int8_engine.generate(
        input_ids=[ids, *others], sampling_params={"max_new_tokens": 24, **GREEDY}
    )
    assert len(alone["output_ids"]) == 24
    assert batch[0]["output_ids"] == alone["output_ids"]
    # The first 8 generated tokens prefilled as part of the prompt: the rest decodes the same.
    resumed = int8_engine.generate(
        input_ids=ids + alone["output_ids"][:8], sampling_params={"max_new_tokens": 16, **GREEDY}
    )
    assert resumed["output_ids"] == alone["output_ids"][8:]


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_bf16_batches_where_bf16_products_do_not_pay_take_a_float32_gemm(monkeypatch):
    """The path of CPUs with neither AMX nor AVX512-BF16 dot products that pay (bf16_probe.c),
    kept tested everywhere: a bf16 batch past 16 rows multiplies the weight decoded to float32
    into the scratch with PyTorch's float32 GEMM, rounded to bf16 once."""
    monkeypatch.setattr(kernels, "tile_gemm_available", lambda: False)
    monkeypatch.setattr(kernels, "bf16_matmul_pays", lambda: False)
    rng = np.random.default_rng(9)
    weight = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 64, 512, rng))], 512)
    x = torch.randn(40, 512).to(torch.bfloat16)
    wide = weight.decoded(torch.float32).clone()
    out = weight.matmul(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.linear(x.float(), wide).to(torch.bfloat16))
