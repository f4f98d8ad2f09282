"""benchmarks/bench_products.py on the default model: one row per weight kind and row count,
and the kernel it says the model takes is the weight's own threshold's (never the tile GEMM
where bf16 products do not pay here)."""

from __future__ import annotations

from benchmarks import bench_products
from sglite.runtime.model import kernels


def test_the_table_names_each_kind_and_the_kernel_the_model_takes(capsys):
    assert bench_products.main(["--model", "smollm2-135m", "--rows", "1,24", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in row] for row in rows]
    kinds = {row[0] for row in cells}
    assert {"qkv q4_1", "gate_up q4_1", "down q4_1", "head q8_0"} <= kinds
    for kind, _, rows, gemv_ms, tile_ms, _, takes in cells:
        assert float(gemv_ms) > 0
        if rows == "1" or tile_ms == "-":
            assert takes == "gemv", kind
        else:  # 24 rows: past every threshold
            assert takes == ("tile" if kernels.bf16_matmul_pays() else "gemv"), kind
    assert "of an FMA's rate" in out
