"""The cost of deterministic inference (`--enable-deterministic-inference`), alternated.

Engines on a model (`--model`, default: the default model) with the mode off and on, in each
of `--dtypes` (`auto` included: float32 with int8-rounded products on a CPU without bf16, where
the mode tiles a GGUF's weights for the VNNI GEMM; docs/deterministic.md), in float32 and
bfloat16 by default (where the CPU
has no native bf16, PyTorch and the native kernels compute it anyway: the figures then say
what this host does, not what a bf16 host would). Per round and engine, in turn:
- prefill: a ~1000-token prompt (`--prompt-lines 70`), cache flushed, 1 new token (prompt tok/s);
- batch-1 decode: 64 tokens after a cached prompt, a 1-token run's time subtracted (tok/s);
- 32 concurrent: 32 different prompts, 32 new tokens each (output tok/s).
The table gives each figure's median over the rounds and the on/off ratio.

Where the CPU has no native bf16, PyTorch emulates the bf16 GEMM at a small fraction of
float32's rate, so a bf16 prefill of 1000 tokens is very slow, and 32 concurrent requests past
the 8 rows bf16 runs quantized take the dense bf16 GEMM: give such hosts a shorter prompt
(`--prompt-lines 8`) and `--skip-concurrent`.

Run: python -m benchmarks.bench_deterministic [--model M] [--rounds 3]
     [--dtypes float32,bfloat16] [--prompt-lines 70]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import sglite

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def long_prompt(lines: int) -> str:
    """About 14 tokens per line."""
    line = "Line {}: the keeper wound the clockwork and trimmed the wick."
    text = " ".join(line.format(i) for i in range(lines))
    return CHAT.format(text + " Summarize.")


SHORT = CHAT.format("Tell me about lighthouses.")
CONCURRENT = [CHAT.format(f"Write a short poem about the number {i}.") for i in range(32)]


def prefill_rate(engine: sglite.Engine, prompt: str) -> float:
    engine.flush_cache()
    start = time.perf_counter()
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1})
    return out["meta_info"]["prompt_tokens"] / (time.perf_counter() - start)


def decode_rate(engine: sglite.Engine, tokens: int = 64) -> float:
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    engine.generate(SHORT, params)
    start = time.perf_counter()
    engine.generate(SHORT, params)
    first = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(SHORT, {**params, "max_new_tokens": tokens})
    return (tokens - 1) / (time.perf_counter() - start - first)


def concurrent_rate(engine: sglite.Engine, tokens: int = 32) -> float:
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(CONCURRENT, [params] * len(CONCURRENT))
    done = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a GGUF path or known name")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-lines", type=int, default=70)
    parser.add_argument("--skip-concurrent", action="store_true")
    args = parser.parse_args()
    prompt = long_prompt(args.prompt_lines)
    measures = {
        "prefill (tok/s)": lambda engine: prefill_rate(engine, prompt),
        "batch-1 decode (tok/s)": decode_rate,
        "32 concurrent (out tok/s)": concurrent_rate,
    }
    if args.skip_concurrent:
        del measures["32 concurrent (out tok/s)"]
    engines = {}
    for dtype in args.dtypes.split(","):
        for mode in (False, True):
            engines[dtype, mode] = sglite.Engine(
                model_path=args.model,
                dtype=dtype,
                enable_deterministic_inference=mode,
                max_total_tokens=8192,
                log_level="error",
            )
    info = next(iter(engines.values())).get_server_info()
    print(f"model {info['model_path']}, weights {info['weight_layouts']}, ")
    for (dtype, mode), engine in engines.items():
        quantization = engine.get_server_info()["quantization"]
        print(f"  {dtype}, deterministic {mode}: {quantization}")
    print(f"kernels {info['kernel_isa'] or 'portable C'}, torch threads {torch.get_num_threads()}")
    results: dict[tuple, list[float]] = defaultdict(list)
    try:
        for _ in range(args.rounds):
            for name, measure in measures.items():
                for key, engine in engines.items():
                    results[(*key, name)].append(measure(engine))
                print(f"  {name}: done", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print("\n| dtype | measure | off | deterministic | ratio |")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        for name in measures:
            off = statistics.median(results[dtype, False, name])
            on = statistics.median(results[dtype, True, name])
            print(f"| {dtype} | {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()
