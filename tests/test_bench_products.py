"""benchmarks/bench_products.py on the default model: one row per weight kind and row count,
and the kernel it says the model takes is the weight's own thresholds' (never the tile GEMM
where bf16 products do not pay here, nor before the VNNI GEMM without AMX); the tiled GEMM's
column where the VNNI GEMM serves a tiled copy, the kernel a weight held tiled takes at every
row count."""

from __future__ import annotations

from test_gguf_activations import VNNI_GEMM

from benchmarks import bench_products
from sglite.runtime.model import kernels
from sglite.runtime.model.loader import default_tiled_types


def test_the_table_names_each_kind_and_the_kernel_the_model_takes(capsys):
    assert bench_products.main(["--model", "smollm2-135m", "--rows", "1,24", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in row] for row in rows]
    kinds = {row[0] for row in cells}
    assert {"qkv q4_1", "gate_up q4_1", "down q4_1", "head q8_0"} <= kinds
    for kind, _, rows, gemv_ms, vnni_ms, tiled_ms, tile_ms, takes in cells:
        assert float(gemv_ms) > 0
        if kind.endswith("q4_1"):
            assert tiled_ms == "-", kind  # Q4_1 is not tiled
        else:
            assert (tiled_ms != "-") == VNNI_GEMM, kind
        if kind.split()[-1].upper() in default_tiled_types():  # held tiled: its one kernel
            assert takes == "tiled", kind
        elif rows == "1":
            assert takes == "gemv", kind
        elif vnni_ms != "-" and not kernels.amx_available():  # 24 rows: past every threshold
            assert takes == "vnni", kind  # int8 products before AVX512-BF16 ones
        elif tile_ms != "-" and kernels.bf16_matmul_pays():
            assert takes == "tile", kind
        else:
            assert takes == ("vnni" if vnni_ms != "-" else "gemv"), kind
    assert "of an FMA's rate" in out
    assert "512-bit operations: " in out


def test_another_kernel_build_alternates_with_this_one_on_the_same_weights(capsys):
    """`--against-kernels` with this build's own library: its GEMV column beside this build's,
    their ratio, and the same bits on every row (one build, one result); the path of this
    build's library is printed for a later run to compare against."""
    from sglite.runtime.model.kernels.native import load

    mine = load()._name
    argv = ["--model", "smollm2-135m", "--rows", "1,5", "--rounds", "1"]
    assert bench_products.main([*argv, "--against-kernels", mine]) == 0
    out = capsys.readouterr().out
    assert f"kernels: {mine}" in out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    heads = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert heads[-4:] == [
        "other build's int8 GEMV ms",
        "other / this",
        "same bits",
        "a target takes",
    ]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[1:]]
    assert len(rows) >= 8
    for row in rows:
        assert float(row[-4]) > 0 and row[-3].endswith("x")
        assert row[-2] == "yes", row
