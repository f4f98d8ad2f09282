"""GGUF blocks through the tile GEMM (kernels/gguf_amx.c, bf16 batches past the GEMV's rows: on
AMX tiles, or with AVX512-BF16 dot products on CPUs without AMX): the product is x times the
weight decoded to bfloat16, summed in float32, for every block type, fused parts of mixed
types, widths that are not whole tiles and k cut into chunks; a row's result does not depend on
the other rows. On an AMX host the vector path is checked too, in a process where
SGLITE_AMX=0 keeps the tiles off. Elsewhere the kernel declines (-1) and the other paths serve
the same calls (their tests run everywhere)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.kernels.abi import ABI
from tests.test_gguf_activations import _blocks

pytestmark = pytest.mark.skipif(
    not kernels.native_available() or not kernels.tile_gemm_available(),
    reason="needs a CPU with AMX or AVX512-BF16",
)

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _reference(weight: GGUFWeight, x: torch.Tensor) -> torch.Tensor:
    """x times the weight rounded to bf16 (gguf_dequantize's decoding), in float64."""
    return F.linear(x.double(), weight.decoded(torch.bfloat16).double())


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # One bf16 rounding of the result (2^-9 relative) plus float32 sums.
    err = (out.double() - ref).abs().max().item()
    assert err <= 6e-3 * ref.abs().max().item(), err


@pytest.mark.parametrize("type_name", TYPES)
def test_every_block_type_is_x_times_the_bf16_weight(type_name):
    rng = np.random.default_rng(11)
    weight = GGUFWeight([GGUFPart(type_name, _blocks(type_name, 72, 512, rng))], 512)
    for rows in (6, 40):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        out = kernels.gguf_gemm_amx(x, weight.address, weight.out_features)
        assert out is not None and out.dtype == torch.bfloat16 and out.shape == (rows, 72)
        _assert_close(out, _reference(weight, x))


@pytest.mark.parametrize("type_name", TYPES)
def test_the_decoded_weight_is_the_scratch_paths_bit_for_bit(type_name):
    """x = the identity: each output row is a column of the weight as the kernel decoded it
    (a product by 1 and sums of zeros are exact), equal to gguf_dequantize's bf16 weight."""
    rng = np.random.default_rng(15)
    weight = GGUFWeight([GGUFPart(type_name, _blocks(type_name, 40, 512, rng))], 512)
    eye = torch.eye(512, dtype=torch.bfloat16)
    out = kernels.gguf_gemm_amx(eye, weight.address, weight.out_features)
    assert torch.equal(out.T, weight.decoded(torch.bfloat16))


def test_mixed_parts_and_k_in_several_chunks():
    """A fused q4_k + q6_k projection (as Q4_K_M files store q/k/v) whose k (2304) is more
    than one chunk of 2048 values, with 200 rows (not whole tiles) and 70 x rows."""
    rng = np.random.default_rng(12)
    parts = [
        GGUFPart("Q4_K", _blocks("Q4_K", 136, 2304, rng)),
        GGUFPart("Q6_K", _blocks("Q6_K", 64, 2304, rng)),
    ]
    weight = GGUFWeight(parts, 2304)
    x = torch.randn(70, 2304).to(torch.bfloat16)
    out = kernels.gguf_gemm_amx(x, weight.address, weight.out_features)
    _assert_close(out, _reference(weight, x))


def test_a_rows_result_depends_on_that_row_alone():
    rng = np.random.default_rng(13)
    weight = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 96, 768, rng))], 768)
    x = torch.randn(300, 768).to(torch.bfloat16)
    alone = kernels.gguf_gemm_amx(x[50:51].contiguous(), weight.address, 96)
    for start, rows in ((50, 9), (40, 17), (0, 100), (33, 64), (0, 300), (20, 161)):
        batch = kernels.gguf_gemm_amx(x[start : start + rows].contiguous(), weight.address, 96)
        assert torch.equal(batch[50 - start], alone[0]), (start, rows)


# The dispatch tests below need the tile GEMM to be this host's choice for bf16 batches; where
# bf16 products do not pay (bf16_probe.c), test_dispatch_where_bf16_dot_products_are_taken
# runs them in a process that takes them (SGLITE_BF16_DOT=1).
dispatch = pytest.mark.skipif(
    not kernels.bf16_matmul_pays(), reason="bf16 products do not pay here: run in a subprocess"
)


@dispatch
def test_bf16_batches_past_the_gemv_take_it_and_float32_never_does():
    """`matmul` sends a bf16 batch of `amx_min_rows` or more rows to the tile GEMM (the same
    values) and keeps float32 batches on the exact float32 GEMM."""
    rng = np.random.default_rng(14)
    weight = GGUFWeight([GGUFPart("Q6_K", _blocks("Q6_K", 48, 256, rng))], 256)
    x = torch.randn(weight.amx_min_rows, 256)
    amx = kernels.gguf_gemm_amx(x.to(torch.bfloat16), weight.address, 48)
    assert torch.equal(weight.matmul(x.to(torch.bfloat16)), amx)
    assert kernels.gguf_gemm_amx(x, weight.address, 48) is None  # float32: not this kernel
    exact = F.linear(x.double(), weight.decoded(torch.float32).double())
    assert (weight.matmul(x).double() - exact).abs().max().item() < 1e-4


@dispatch
def test_weights_mostly_of_q6_k_take_the_tiles_later(monkeypatch):
    """Q6_K decodes to bf16 slower than Q4_K, so a weight mostly of Q6_K rows keeps the other
    paths to AMX_MIN_ROWS_Q6_K rows (without AMX: BF16_DOT_MIN_ROWS_Q6_K, or _Q6_K_SHORT for
    rows of at most SHORT_ROW_VALUES values, an output head's); a Q4_K weight, or a fused one
    with a Q6_K minority (a Q4_K_M file's q/k/v), switches at AMX_MIN_ROWS
    (BF16_DOT_MIN_ROWS). `matmul` follows the weight's threshold."""
    rng = np.random.default_rng(21)
    q4k = GGUFPart("Q4_K", _blocks("Q4_K", 64, 256, rng))
    q6k = GGUFPart("Q6_K", _blocks("Q6_K", 48, 256, rng))
    long = ABI.constants["SHORT_ROW_VALUES"] + 256  # rows longer than an output head's
    names = ("AMX_MIN_ROWS", "AMX_MIN_ROWS_Q6_K", "AMX_MIN_ROWS_Q6_K")
    if not kernels.amx_available():
        names = ("BF16_DOT_MIN_ROWS", "BF16_DOT_MIN_ROWS_Q6_K_SHORT", "BF16_DOT_MIN_ROWS_Q6_K")
    low, high, higher = (ABI.constants[name] for name in names)
    assert low < high <= higher
    assert (
        GGUFWeight([GGUFPart("Q6_K", _blocks("Q6_K", 16, long, rng))], long).amx_min_rows == higher
    )
    assert GGUFWeight([q4k], 256).amx_min_rows == low
    assert GGUFWeight([q4k, q6k], 256).amx_min_rows == low
    assert GGUFWeight([q6k], 256).amx_min_rows == high
    assert GGUFWeight([q6k, GGUFPart("Q4_K", q4k.data[:16])], 256).amx_min_rows == high
    weight = GGUFWeight([q6k], 256)
    assert weight.native_linear(None).amx_min_rows == high  # the decode step's threshold too
    x = torch.randn(high, 256).to(torch.bfloat16)
    below = weight.matmul(x[: high - 1])
    monkeypatch.setattr(kernels, "tile_gemm_available", lambda: False)
    assert torch.equal(below, weight.matmul(x[: high - 1]))  # the path without the tile GEMM
    monkeypatch.undo()
    assert torch.equal(weight.matmul(x), kernels.gguf_gemm_amx(x, weight.address, 48))


@dispatch
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_gated_product_is_the_unfused_ones_bit_for_bit(act):
    """`matmul_gated` on a fused [gate; up] weight (mixed parts, k in two chunks, 5 blocks of
    output columns with a partial last one, 70 rows: a lone last x tile) equals the product
    followed by `gated_act`, bit for bit, and a row's result depends on that row alone."""
    rng = np.random.default_rng(16)
    inter, k = 352, 2304
    parts = [
        GGUFPart("Q4_K", _blocks("Q4_K", inter, k, rng)),
        GGUFPart("Q6_K", _blocks("Q6_K", inter, k, rng)),
    ]
    weight = GGUFWeight(parts, k)
    x = torch.randn(70, k).to(torch.bfloat16)
    fused = weight.matmul_gated(x, act)
    assert fused is not None and fused.shape == (70, inter)
    assert torch.equal(fused, kernels.gated_act(weight.matmul(x), act))
    end = 3 + weight.amx_min_rows  # a smaller batch, still past the tiles' rows
    assert torch.equal(weight.matmul_gated(x[3:end].contiguous(), act), fused[3:end])
    # Below the tiles' rows there is no fused kernel: the caller takes the unfused form.
    assert weight.matmul_gated(x[:2].contiguous(), act) is None
    odd = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 48, 256, rng))], 256)  # 24: no whole tile
    assert odd.matmul_gated(torch.randn(16, 256).to(torch.bfloat16), act) is None


VECTOR_CHECK = """
import numpy as np, torch, torch.nn.functional as F
from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from tests.test_gguf_activations import _blocks
assert not kernels.amx_available() and kernels.tile_gemm_available()
rng = np.random.default_rng(16)
parts = [GGUFPart(t, _blocks(t, n, 2304, rng)) for t, n in (("Q4_K", 40), ("Q6_K", 32))]
weight = GGUFWeight(parts, 2304)
x = torch.randn(37, 2304).to(torch.bfloat16)
out = kernels.gguf_gemm_amx(x, weight.address, 72)
ref = F.linear(x.double(), weight.decoded(torch.bfloat16).double())
assert (out.double() - ref).abs().max().item() <= 6e-3 * ref.abs().max().item()
alone = kernels.gguf_gemm_amx(x[5:6].contiguous(), weight.address, 72)
assert torch.equal(out[5], alone[0])
gated = kernels.gguf_gemm_amx_glu(x, weight.address, 64, kernels.ACTIVATION_CODES["silu"])
assert gated is not None and gated.shape == (37, 32)
print("ok")
"""


@pytest.mark.skipif(not kernels.amx_available(), reason="the vector path runs in the tests above")
def test_without_amx_the_vector_path_computes_the_same_product():
    """SGLITE_AMX=0 keeps the tiles off, as on a CPU with AVX512-BF16 and no AMX: the product of
    a fused q4_k + q6_k weight over two chunks of k, a row's result alone, the gated form."""
    env = {**os.environ, "SGLITE_AMX": "0"}
    done = subprocess.run(
        [sys.executable, "-c", VECTOR_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(kernels.bf16_matmul_pays(), reason="the dispatch tests ran in this process")
def test_dispatch_where_bf16_dot_products_are_taken():
    """On a CPU whose AVX512-BF16 dot products are too slow to pay, the tile GEMM's dispatch
    (thresholds, matmul, the gated form) is still checked: in a process where SGLITE_BF16_DOT=1
    takes them."""
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "tiles_later or take_it or gated"]
    done = _run([*args, __file__], SGLITE_BF16_DOT="1", SGLITE_AMX="0")
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:]


DECISION_CHECK = """
import numpy as np, torch, torch.nn.functional as F
from sglite.runtime.model import gguf_weight, kernels
from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.kernels.abi import ABI
from tests.test_gguf_activations import _blocks
assert not kernels.amx_available() and kernels.bf16_dot_speed_percent() > 0
rng = np.random.default_rng(30)
weight = GGUFWeight([GGUFPart("Q4_K", _blocks("Q4_K", 96, 512, rng))], 512)
x = torch.randn(40, 512).to(torch.bfloat16)
if kernels.bf16_matmul_pays():
    assert weight.amx_min_rows == ABI.constants["BF16_DOT_MIN_ROWS"]
    assert torch.equal(weight.matmul(x), kernels.gguf_gemm_amx(x, weight.address, 96))
    print("tiles")
else:
    off = ABI.constants["KERNEL_OFF_ROWS"]
    assert weight.amx_min_rows == off and weight.native_linear(None).amx_min_rows == off
    wide = F.linear(x.float(), weight.decoded(torch.float32)).to(torch.bfloat16)
    assert torch.equal(weight.matmul(x), wide)  # float32 GEMM on the float32 weight
    gguf_weight.FLOAT32_SCRATCH_BYTES = 512 * 4 * 40  # 40 rows at a time: 3 slices
    assert torch.equal(weight.matmul(x), wide)
    assert weight.matmul_gated(x, "silu") is None
    print("float32")
"""


@pytest.mark.parametrize(("setting", "path"), [("1", "tiles"), ("0", "float32")])
def test_the_measured_rate_decides_the_bf16_products(setting, path):
    """Where bf16 dot products pay (SGLITE_BF16_DOT=1 stands in for a fast measurement), a bf16
    batch past the GEMV takes the tile GEMM; where they do not (=0, as measured on an Intel
    Xeon without AMX), no weight does, and a large bf16 batch multiplies the weight decoded to
    float32 (in slices of FLOAT32_SCRATCH_BYTES) in a float32 GEMM, the result rounded once."""
    done = _run(["-c", DECISION_CHECK], SGLITE_BF16_DOT=setting, SGLITE_AMX="0")
    assert done.returncode == 0 and done.stdout.strip() == path, done.stderr[-3000:]
