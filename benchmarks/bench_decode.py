"""Batch-1 decode, sglite against llama.cpp, interleaved round by round.

On a shared machine the speed of memory and cores drifts by 20-40% within minutes, more than the
gap being measured, so `bench_engine`'s single sglite-then-llama.cpp pass can land either side of
1.0x. Here each round measures sglite, then llama-bench, back to back, and the result is the
median of the per-round ratios (with their spread).

Per round and context depth (0 and 2000 tokens before the decoded ones):
- sglite: one Engine for the whole run; tokens/s of decoding `--tokens` tokens after a prompt kept
  in the radix cache (`bench_engine.decode_rate_at_depth`: a long prefill's noise drops out);
- llama.cpp: `llama-bench -p 0 -n TOKENS -d DEPTH -r 1` on the same GGUF and thread count.

Run: python -m benchmarks.bench_decode [--rounds 5] [--quantization w4a8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch

import sglite
from benchmarks.bench_engine import decode_rate_at_depth, exact_prompt_ids, llama_binaries
from sglite.runtime.model.loader import default_model_path

DEPTHS = (0, 2000)


def llama_decode_rate(bench: str, threads: int, tokens: int, depth: int) -> float:
    """llama-bench's tokens/s for `tokens` decoded after `depth` tokens of context."""
    cmd = [bench, "-m", default_model_path(), "-p", "0", "-n", str(tokens), "-d", str(depth)]
    cmd += ["-t", str(threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main() -> None:
    """Run the rounds and print each one, then the median ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--quantization", default="w4a8", choices=["none", "int8", "int4", "w4a8"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    bench, _ = llama_binaries()
    if bench is None:
        raise SystemExit("llama.cpp is not built: run bash benchmarks/build_llama_cpp.sh first")
    torch.set_num_threads(args.threads)
    ratios: dict[int, list[float]] = {d: [] for d in DEPTHS}
    print(f"sglite --quantization {args.quantization} vs llama.cpp Q4_1, {args.threads} threads")
    print("| round | depth | sglite tok/s | llama.cpp tok/s | ratio |\n|---:|---:|---:|---:|---:|")
    with sglite.Engine(
        num_threads=args.threads, log_level="error", quantization=args.quantization
    ) as engine:
        prompts = {d: exact_prompt_ids(engine.tokenizer, max(d, 16), seed=5) for d in DEPTHS}
        decode_rate_at_depth(engine, prompts[0], 16)  # warm-up
        for r in range(1, args.rounds + 1):
            for depth in DEPTHS:
                ours = decode_rate_at_depth(engine, prompts[depth], args.tokens)
                theirs = llama_decode_rate(bench, args.threads, args.tokens, depth)
                ratios[depth].append(ours / theirs)
                print(f"| {r} | {depth} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    for depth in DEPTHS:
        values = ratios[depth]
        print(
            f"depth {depth}: median {statistics.median(values):.2f}x "
            f"(min {min(values):.2f}x, max {max(values):.2f}x, {len(values)} rounds)"
        )


if __name__ == "__main__":
    main()
