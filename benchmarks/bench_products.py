"""A GGUF model's projections by row count: the int8 GEMV (gguf_gemv_a8), the VNNI GEMM
(gguf_gemm_a8, where the build has 512-bit VNNI and it serves the weight) and the tile GEMM
(gguf_gemm_amx: AMX tiles, or AVX512-BF16 dot products on CPUs without AMX) on the weights as
the file stores them, bfloat16 x; for weights with Q5_0, Q8_0, Q4_K or Q6_K parts also the VNNI
GEMM on them tiled (`gguf_tiles.h`), as the loader holds them where every product rounds x and
the CPU has no AMX.

For each kind of weight in the model (the fused q/k/v, the MLP's gate_up, a down projection of
each block type, the output head) and each row count, the kernels that run here alternate,
`--rounds` times each, and the table prints each one's best time in ms and which one the model
takes at that count (`GGUFWeight.amx_min_rows` and `a8_gemm_min_rows`, from the weight's block
types and the CPU; a tiled weight takes the tiled GEMM at every count). These are the data
behind the `AMX_MIN_ROWS`, `BF16_DOT_MIN_ROWS` and `A8_GEMM_MIN_ROWS` families (kernels.h): a
verification of a speculative draft, or a small decode batch, is such a product per layer.

`--against-kernels PATH`: another build of the kernel library (the `cpu_kernels-*.so` that a
checkout of another revision built into the kernel cache; the run prints the path of its own)
whose int8 GEMV alternates with this build's on the same weights in the same process (separate
processes differ by more than such a change: where their pages land, the host's drift), with
the ratio and whether the two give the same bits. The data behind a change to the GEMV.

Run: python -m benchmarks.bench_products [--model qwen2.5-coder-1.5b] [--rows 1,2,4,6,8,9,12,16]
[--rounds 15] [--against-kernels PATH]
"""

from __future__ import annotations

import benchmarks.scheduler_env  # noqa: F401  (first: the scheduler's OpenMP setting)

# isort: split
import ctypes
import time
from collections.abc import Callable

import torch

from benchmarks.common import command_line, make_parser, markdown_table
from benchmarks.host import cpu_line
from sglite.runtime.model import kernels
from sglite.runtime.model.catalog import resolve_model_path
from sglite.runtime.model.gguf_block_weights import tiled_parts
from sglite.runtime.model.gguf_part import TILED_TYPES
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.kernels.gguf_matmul import _call_gguf as call_gguf
from sglite.runtime.model.kernels.native import load as load_kernels
from sglite.runtime.model.loader import load_model

KERNEL_OFF_ROWS = ABI.constants["KERNEL_OFF_ROWS"]


def weights_by_kind(model) -> dict[str, GGUFWeight]:
    """One weight of each (projection, block types) kind in the model, and the head, as the
    model holds them (named by the file's block types)."""
    found: dict[str, GGUFWeight] = {}
    for layer in model.layers:
        for name, linear in (
            ("qkv", layer.self_attn.qkv_proj),
            ("gate_up", layer.mlp.gate_up_proj),
            ("down", layer.mlp.down_proj),
        ):
            weight = linear.quantized
            if isinstance(weight, GGUFWeight):
                found.setdefault(f"{name} {file_rows(weight).kind}", weight)
    head = getattr(model, "lm_head_quantized", None)
    if isinstance(head, GGUFWeight):
        found[f"head {file_rows(head).kind}"] = head
    return found


def file_rows(weight: GGUFWeight) -> GGUFWeight:
    """The weight with its parts as the file stores them (tiled ones untiled)."""
    if not weight.tiled:
        return weight
    parts = [p.as_stored() for p in weight.parts]
    return GGUFWeight(parts, weight.in_features, round_activations=True)


def call_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def tiled_copy(weight: GGUFWeight) -> GGUFWeight | None:
    """The weight (as the file stores it) with its Q5_0, Q8_0, Q4_K and Q6_K parts tiled, or
    None where it has none or the VNNI GEMM cannot serve it."""
    parts = tiled_parts(weight.parts, weight.in_features, frozenset(TILED_TYPES))
    return None if parts is None else GGUFWeight(parts, weight.in_features, round_activations=True)


def other_gemv(library: ctypes.CDLL) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """`gguf_gemv_a8` of another build of the kernel library, called as this build's is."""
    ABI.declare(library)

    def call(x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor:
        out = call_gguf(library.gguf_gemv_a8, x, parts, n_out, 0)
        if out is None:
            raise RuntimeError("the other build's gguf_gemv_a8 refused the weight")
        return out

    return call


def same_bits(weight: GGUFWeight, rows: int, other: Callable) -> bool:
    """Whether this build's int8 GEMV and the other's give the same bits on random rows."""
    x = torch.randn(rows, weight.in_features).to(torch.bfloat16)
    mine = kernels.gguf_gemv_a8(x, weight.address, weight.out_features)
    return torch.equal(mine, other(x, weight.address, weight.out_features))


def measure(
    weight: GGUFWeight,
    tiled: GGUFWeight | None,
    rows: int,
    rounds: int,
    other: Callable | None = None,
) -> dict[str, float]:
    """ms by kernel ("gemv"; "vnni" where the VNNI GEMM serves the weight; "tiled": that GEMM
    on the tiled copy, where there is one; "tile" where the tile GEMM runs here): the best of
    `rounds`, the kernels alternated call by call after one warm-up call each."""
    x = torch.randn(rows, weight.in_features).to(torch.bfloat16)
    kernels_by_name = {"gemv": kernels.gguf_gemv_a8}
    if weight.a8_gemm_min_rows < KERNEL_OFF_ROWS:
        kernels_by_name["vnni"] = kernels.gguf_gemm_a8
    if kernels.tile_gemm_available():
        kernels_by_name["tile"] = kernels.gguf_gemm_amx
    calls = {
        name: (lambda kernel=kernel: kernel(x, weight.address, weight.out_features))
        for name, kernel in kernels_by_name.items()
    }
    if tiled is not None:
        calls["tiled"] = lambda: kernels.gguf_gemm_a8(x, tiled.address, tiled.out_features)
    if other is not None:
        calls["other"] = lambda: other(x, weight.address, weight.out_features)
    for call in calls.values():
        call()  # warm-up
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], call_ms(call))
    return best


def kernel_taken(weight: GGUFWeight, rows: int) -> str:
    """The kernel the model takes for a DECODE batch of `rows` rows (the weight's thresholds;
    a tiled weight's one kernel)."""
    if weight.tiled:
        return "tiled"
    if kernels.tile_gemm_available() and rows >= weight.amx_min_rows:
        return "tile"
    return "vnni" if rows >= weight.a8_gemm_min_rows else "gemv"


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="GGUF path or known name")
    parser.add_argument("--rows", default="1,2,4,5,6,8,9,12,16,20,24,32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--against-kernels", default=None, help="another build's cpu_kernels-*.so (see above)"
    )
    args = parser.parse_args(argv)
    other = other_gemv(ctypes.CDLL(args.against_kernels)) if args.against_kernels else None
    loaded = load_model(
        resolve_model_path(args.model), dtype="bfloat16", quantization="auto", progress=False
    )
    if loaded.huge_pages is not None:  # as a served model is once idle
        loaded.huge_pages.run()
    print(command_line("benchmarks.bench_products"))
    tiles = "AMX" if kernels.amx_available() else "AVX512-BF16"
    rate = kernels.bf16_dot_speed_percent()
    taken = "taken" if kernels.bf16_matmul_pays() else "not taken: bf16 products do not pay"
    print(f"host: {cpu_line()}; tile GEMM: {tiles if kernels.tile_gemm_available() else 'no'}")
    split = "split in two halves" if kernels.vectors_512_split() else "whole"
    print(f"vdpbf16ps at {rate}% of an FMA's rate; the model's tile GEMM: {taken}")
    print(f"512-bit operations: {split} (the VNNI GEMM's thresholds follow)")
    print(f"kernels: {load_kernels()._name}")
    if other is not None:
        print(f"against: {args.against_kernels}")
    table = []
    names = ("gemv", "vnni", "tiled", "tile") + (("other",) if other is not None else ())
    for kind, weight in weights_by_kind(loaded.model).items():
        plain = file_rows(weight)
        tiled = tiled_copy(plain)
        for rows in (int(r) for r in args.rows.split(",")):
            ms = measure(plain, tiled, rows, args.rounds, other)
            cells = [f"{ms[name]:.2f}" if name in ms else "-" for name in names]
            if other is not None:
                same = "yes" if same_bits(plain, rows, other) else "no"
                cells += [f"{ms['other'] / ms['gemv']:.2f}x", same]
            shape = "x".join(map(str, weight.shape()))
            table.append([kind, shape, str(rows), *cells, kernel_taken(weight, rows)])
    heads = ["weight", "shape", "rows", "int8 GEMV ms", "VNNI GEMM ms", "tiled VNNI GEMM ms"]
    heads += ["tile ms"]
    if other is not None:
        heads += ["other build's int8 GEMV ms", "other / this", "same bits"]
    heads += ["a target takes"]
    print(markdown_table(heads, table, right=set(range(2, len(heads) - 1))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
