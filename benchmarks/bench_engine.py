"""Engine benchmark: sglite against the machine's limits, llama.cpp and transformers, one run.

Measured on a GGUF (`--model`; the default model, SmolLM2-135M-Instruct's Q4_1, unless given),
same thread count for all:
- the machine: torch matmul GFLOP/s (float32, bfloat16) and memory read GB/s, from which the
  prefill roofline (the faster matmul's GFLOP/s / the model's GFLOP per prompt token: 2 x its
  layers' parameters, the embedding being a lookup and the output projection computed once per
  prompt) and the batch-1 decode limits follow;
- sglite (`dtype=auto`: bfloat16 where the CPU has it) with each weight format of
  `--quantizations` (for the default model dense, int8, int4 and w4a8, int4 with int8-rounded
  activations in the decode GEMVs, as llama.cpp computes; for others dense and auto): prefill
  of a 1000-token prompt, batch-1 decode (after a 16-token and after a 2000-token prompt; the
  first also as a share of the memory read rate measured just before and after it, which the
  bandwidth target checks: this host's rate drifts between minutes), 32
  concurrent decoding requests, and the shared-prefix workload (64 x (800 shared + 30 own
  tokens), 64 new tokens, greedy);
- accuracy of each weight format against float32 (max logit error, teacher-forced greedy
  agreement over a few prompts);
- llama.cpp (`llama-bench` pp1000 / tg128, and tg128 at depth 2000, on the same GGUF;
  `llama-server` with 16 slots and `cache_prompt` on the shared-prefix workload) when
  `benchmarks/build_llama_cpp.sh` built it;
- transformers (same GGUF, float32 and bfloat16): prefill and batch-1 decode.
Each figure is printed beside its target (`targets`: shares of the machine's limits, ratios to
llama.cpp and transformers). llama.cpp is the build `runners.llama_cpp.find_llama_server` picks
(`--llama-server PATH`, else the build script's best configuration for the host, else PATH),
named in its rows and in the report's `llama.cpp:` line (the script's `BUILD` record). A run
that crashes is a row of its own, "crashed at start-up (exit -11 SIGSEGV, log: PATH)", and a
line under "Not measured or crashed"; when llama-bench crashes, it is measured again with
`--repack 0` and those rows say "fallback: --repack 0, the default crashed", never silently.
Ratios are what to quote; absolute times on a shared machine are noisy.

Run: python -m benchmarks.bench_engine [--model PATH.gguf] [--quick] [--skip-llama-cpp]
[--skip-transformers] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch

from benchmarks.common import add_json_option, add_llama_server_option
from benchmarks.engine_accuracy import bench_accuracy
from benchmarks.engine_machine import bench_machine, gflop_per_token, weight_bytes_per_token
from benchmarks.engine_peers import bench_llama_cpp, bench_transformers
from benchmarks.engine_report import report
from benchmarks.engine_rows import EchoList, Row
from benchmarks.engine_sglite import bench_sglite
from sglite.runtime.model.catalog import resolve_model_path


def main() -> None:
    """Parse flags, run every system, print the table and the targets."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", help="a GGUF file or known model name (default: the default model)"
    )
    parser.add_argument(
        "--quantizations",
        help="comma-separated weight formats to run: none (dense), int8, int4, w4a8, auto (a "
        "GGUF's own blocks, the host's activation path), auto/float or auto/int8 (blocks with "
        "that path); default model: none,int8,int4,w4a8,auto/float,auto/int8; others: "
        "none,auto/float,auto/int8",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and workloads")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--accuracy-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    add_llama_server_option(parser)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    add_json_option(parser)
    args = parser.parse_args()
    default = args.model is None
    args.model = resolve_model_path(args.model)
    blocks = "auto/float,auto/int8"
    formats = args.quantizations or (
        f"none,int8,int4,w4a8,{blocks}" if default else f"none,{blocks}"
    )
    args.quantizations = formats.split(",")
    if args.quick:
        args.requests, args.new_tokens, args.repeats, args.accuracy_tokens = 16, 16, 1, 8
    torch.set_num_threads(args.threads)
    rows: list[Row] = EchoList()
    machine = bench_machine(rows, gflop_per_token(args.model), weight_bytes_per_token(args.model))
    for quantization in args.quantizations:
        bench_sglite(args, rows, quantization)
    if not args.skip_accuracy:
        bench_accuracy(args, rows)
    notes: list[str] = []
    if not args.skip_llama_cpp:
        notes += bench_llama_cpp(args, rows)
    if not args.skip_transformers:
        if importlib.util.find_spec("accelerate") is None:
            notes.append(
                "transformers not run: it loads a GGUF only with accelerate, which is "
                "not installed (pip install -e '.[bench]')"
            )
        else:
            bench_transformers(args, rows, torch.float32)
            bench_transformers(args, rows, torch.bfloat16)
    report(rows, machine, args, notes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
