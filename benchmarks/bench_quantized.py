"""Quantized models with and without a dense float32 copy, alternated round by round.

In float32 a quantized model keeps no dense copy of its projections by default: the quantized
GEMVs serve up to 8 rows and the quantized GEMM (`kernels/quant_gemm.c`) every larger batch.
This measures what that costs or gains against the old layout, where batches past 8 rows used a
dense float32 copy in panels (`--quantized-max-rows 8`), in one process so the host's drift
falls out of the ratios:
- the GEMMs alone: the default model's 30 layers of projection shapes (int4 GEMM vs float32
  panel GEMM), weights streamed from memory as in decode;
- decode steps of B concurrent requests (ms per step after the prefills);
- prefill of a 1000-token prompt;
- the memory each layout takes (weights, and the process when loaded on its own).

Run: python -m benchmarks.bench_quantized [--quantization int4] [--rounds 5] [--batches 16 32 64]
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # as the scheduler process runs

import argparse  # noqa: E402
import gc
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.profile_decode import run_decode_only
from sglite.runtime.model import kernels
from sglite.runtime.model.loader import LoadedModel, load_model
from sglite.runtime.model.quantization import Int4Weight, quantize_int4
from sglite.runtime.scheduler.io import GenerateInput
from sglite.runtime.scheduler.scheduler import Scheduler
from sglite.runtime.server_args import ServerArgs

# The default model's projection shapes (out, in): fused qkv, o, fused gate-up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYOUTS = {"quantized only": -1, "dense copy": 8}


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median of the per-round ratios b / a (how much faster a is)."""
    return statistics.median(y / x for x, y in zip(a, b, strict=True))


def gemm_rounds(rows_list: list[int], rounds: int) -> None:
    """int4 GEMM against the float32 panel GEMM over 30 layers of the model's shapes."""
    torch.manual_seed(0)
    layers = []
    for _ in range(30):
        for n, k in SHAPES:
            q = Int4Weight(quantize_int4(torch.randn(n, k) * 0.05), torch.float32)
            dense = kernels.int4_dequantize(q.packed, q.scale_offset, torch.float32)
            layers.append((n, k, q, kernels.pack_panels(dense)))

    def run(quantized: bool, rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        start = time.perf_counter()
        for n, k, q, panels in layers:
            if quantized:
                out = kernels.int4_gemm(xs[k], q.packed, q.scale_offset)
            else:
                out = kernels.panel_gemm(xs[k], panels, None, n)
            assert out is not None, "a kernel declined the product: nothing to time"
        return time.perf_counter() - start

    print("\nGEMMs, 30 layers (ms, median of rounds)\n")
    print("| rows | int4 GEMM | float32 panels | int4 faster by |\n|---:|---:|---:|---:|")
    for rows in rows_list:
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for quantized in (True, False):
                times[quantized].append(run(quantized, rows))
        q, d = statistics.median(times[True]), statistics.median(times[False])
        ratio = median_ratio(times[True], times[False])
        print(f"| {rows} | {q * 1e3:.1f} | {d * 1e3:.1f} | {ratio:.2f}x |")


def prefill_seconds(sched: Scheduler, tag: str, seed: int) -> float:
    """Time to prefill one 1000-token prompt (a new one each call: no cache hits)."""
    ids = [(13 * j + 7 * seed) % 30000 + 100 for j in range(1000)]
    sched.add_request(GenerateInput(tag, ids, {"temperature": 0, "max_new_tokens": 1}))
    start = time.perf_counter()
    while sched.has_work:
        sched.step()
    return time.perf_counter() - start


def engine_rounds(args: argparse.Namespace) -> None:
    """Decode steps and prefill, both layouts in one process, alternated."""
    loaded: dict[str, LoadedModel] = {}
    scheds: dict[str, Scheduler] = {}
    for name, rows in LAYOUTS.items():
        loaded[name] = load_model(
            None,
            "float32",
            progress=False,
            quantization=args.quantization,
            quantized_max_rows=rows,
        )
        server_args = ServerArgs(
            dtype="float32",
            max_total_tokens=65536,
            quantization=args.quantization,
            quantized_max_rows=rows,
            max_running_requests=max(64, *args.batches),
            disable_radix_cache=True,
        )
        scheds[name] = Scheduler(server_args, loaded[name])
    gc.collect()
    gc.freeze()
    params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}
    print(f"\n{args.quantization}, float32, {torch.get_num_threads()} threads\n")
    print("| workload | quantized only | dense copy | quantized only faster by |")
    print("|---|---:|---:|---:|")
    for batch in args.batches:
        workload = argparse.Namespace(batch=batch, prompt_tokens=64)
        runs = {name: run_decode_only(s, workload, params) for name, s in scheds.items()}
        times: dict[str, list[float]] = {name: [] for name in scheds}
        for run in runs.values():
            run("warm")
        for r in range(args.rounds):
            for name, run in runs.items():
                times[name].append(run(f"b{batch}-r{r}"))
        a, b = (statistics.median(times[n]) * 1e3 for n in LAYOUTS)
        ratio = median_ratio(*(times[n] for n in LAYOUTS))
        print(f"| decode, {batch} rows (ms/step) | {a:.1f} | {b:.1f} | {ratio:.2f}x |")
    times = {name: [] for name in scheds}
    for sched in scheds.values():
        prefill_seconds(sched, "warm", 0)
    for r in range(args.rounds):
        for name, sched in scheds.items():
            times[name].append(prefill_seconds(sched, f"p{r}", r + 1))
    a, b = (1000 / statistics.median(times[n]) for n in LAYOUTS)
    ratio = median_ratio(*(times[n] for n in LAYOUTS))
    print(f"| prefill, 1000 tokens (tok/s) | {a:.0f} | {b:.0f} | {ratio:.2f}x |")
    for name, model in loaded.items():
        size = model.model.weight_bytes() / 2**20
        print(f"| weights in memory, {name} (MiB) | {size:.0f} |")


def process_memory(quantization: str) -> None:
    """Resident memory of a fresh process holding the model in each layout."""
    code = (
        "import sys; from sglite.runtime.model.loader import load_model;"
        f"held = load_model(None, 'float32', progress=False, quantization='{quantization}',"
        " quantized_max_rows=int(sys.argv[1]));"
        "print(int(open('/proc/self/statm').read().split()[1]) * 4096)"
    )
    print("\n| process after loading | resident MiB |\n|---|---:|")
    for name, rows in LAYOUTS.items():
        out = subprocess.run(
            [sys.executable, "-c", code, str(rows)], capture_output=True, text=True, check=True
        ).stdout
        print(f"| {quantization}, {name} | {int(out.split()[-1]) / 2**20:.0f} |")


def main() -> None:
    """Parse flags and print the three comparisons."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--gemm-rows", type=int, nargs="+", default=[9, 16, 32, 64, 128])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if not kernels.native_available():
        raise SystemExit("the native kernels are needed (no C compiler?)")
    torch.set_num_threads(args.threads)
    if args.quantization == "int4":
        gemm_rounds(args.gemm_rows, args.rounds)
    engine_rounds(args)
    process_memory(args.quantization)


if __name__ == "__main__":
    main()
