"""sglite's figures in bench_engine, one engine per weight format: prefill, batch-1 decode (and
its share of the memory read rate), decode at depth, 32 concurrent decodes and the
shared-prefix workload; and how a `--quantizations` entry is parsed and named."""

from __future__ import annotations

import argparse
import time

import sglite
from benchmarks.common import wait_settled
from benchmarks.engine_machine import bandwidth_probe, read_gbs, weight_bytes_per_token
from benchmarks.engine_rows import Row
from benchmarks.engine_workloads import (
    LONG_CONTEXT,
    LONG_DECODE,
    best_time,
    exact_prompt_ids,
    shared_prefix_workload,
)

GREEDY = {"temperature": 0, "ignore_eos": True}
# Prefill passes timed (the best counts) even in a quick run: each is short.
PREFILL_REPEATS = 3


def _decode_rate(engine, prompts: list[list[int]], n_dec: int) -> float:
    """Output tokens/s of the decode phase: (full run - first-token run), cache flushed each."""
    engine.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1})
    first = time.perf_counter() - start
    engine.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n_dec + 1})
    total = time.perf_counter() - start
    return len(prompts) * n_dec / (total - first)


BANDWIDTH_SHARE = "batch-1 decode share of the read rate measured around it"


def batch1_decode(engine, prompt: list[list[int]], args: argparse.Namespace) -> tuple[float, float]:
    """(best batch-1 decode tokens/s, its share of the memory bandwidth in %): each repeat's
    weight bytes read per second against the read rate measured just before and after it, as
    this host's rate drifts by 20-30% between minutes."""
    probe, per_token = bandwidth_probe(), weight_bytes_per_token(args.model)
    runs = []
    for _ in range(args.repeats):
        before = read_gbs(probe)
        rate = _decode_rate(engine, prompt, args.decode_tokens)
        around = (before + read_gbs(probe)) / 2
        runs.append((rate, 100 * rate * per_token / (around * 1e9)))
    return max(runs)


def decode_rate_at_depth(engine, prompt: list[int], n_dec: int) -> float:
    """Batch-1 tokens/s of decoding after `prompt`, kept in the radix cache: (n_dec + 1)-token
    run minus 1-token run, both served from the cache, so a long prefill's noise drops out."""

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": tokens})
        return time.perf_counter() - start

    timed(1)  # prefill once: the prompt is then in the cache
    first = timed(1)
    return n_dec / (timed(n_dec + 1) - first)


def split_format(spec: str) -> tuple[str, str]:
    """A weight format of `--quantizations` as (quantization, gguf_activations): "auto" is the
    GGUF's blocks with the host's activation path, "auto/float" and "auto/int8" force one."""
    quantization, _, activations = spec.partition("/")
    return quantization, activations or "auto"


def format_name(kind: str, activations: str) -> str:
    """A format's label: the block types (or dense), with a8 where activations are rounded."""
    label = kind if kind != "none" else "dense"
    return f"{label} a8" if activations == "int8" else label


def bench_sglite(args: argparse.Namespace, rows: list[Row], spec: str) -> None:
    """One engine per weight format: prefill, batch-1 and 32-way decode, shared prefix."""
    quantization, activations = split_format(spec)
    engine = sglite.Engine(
        model_path=args.model,
        dtype=args.dtype,
        log_level="error",
        quantization=quantization,
        gguf_activations=activations,
    )
    with engine:
        wait_settled(engine.get_server_info)
        tok = engine.tokenizer
        info = engine.get_server_info()
        kind = info["quantization"] if quantization == "auto" else quantization
        name = f"sglite {info['dtype']} {format_name(kind, info['activations'])}"
        isa = ", ".join(info["kernel_isa"]) or "portable C"
        path = f"native kernels ({isa})" if info["native_kernels"] else "PyTorch (no native)"
        print(f"  {name}: {path}; weights: {'; '.join(info['weight_layouts'])}", flush=True)
        prompt = exact_prompt_ids(tok, 1000, seed=0)

        def prefill() -> None:
            engine.flush_cache()
            engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})

        # Warm-up at the measured size: the first 1000-token pass also pays for first touches
        # of the KV pool's pages and for oneDNN building its kernels for that row count, which
        # a single timed pass (the quick run's) would count as prefill time.
        prefill()
        engine.generate(input_ids=prompt[:100], sampling_params={"max_new_tokens": 2})
        best = best_time(prefill, max(args.repeats, PREFILL_REPEATS))
        rows.append(Row("prefill 1000 tokens", name, 1000 / best, "tok/s"))
        short = [exact_prompt_ids(tok, 16, seed=3)]
        rate, share = batch1_decode(engine, short, args)
        rows.append(Row("batch-1 decode", name, rate, "tok/s"))
        rows.append(Row(BANDWIDTH_SHARE, name, share, "%"))
        deep = exact_prompt_ids(tok, LONG_CONTEXT, seed=5)
        rate = max(decode_rate_at_depth(engine, deep, args.decode_tokens) for _ in range(2))
        rows.append(Row(LONG_DECODE, name, rate, "tok/s"))
        many = [exact_prompt_ids(tok, 64, seed=200 + i) for i in range(32)]
        rate = _decode_rate(engine, many, args.decode_tokens)
        rows.append(Row("32 concurrent decode", name, rate, "out tok/s"))
        if quantization != "none" and args.quick:
            return
        engine.flush_cache()
        before = engine.get_server_info()
        work = shared_prefix_workload(tok, args.requests)
        greedy = {**GREEDY, "max_new_tokens": args.new_tokens}
        start = time.perf_counter()
        outs = engine.generate(input_ids=work, sampling_params=greedy)
        elapsed = time.perf_counter() - start
        after = engine.get_server_info()
        out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        hit = (after["cached_prompt_tokens"] - before["cached_prompt_tokens"]) / max(
            1, after["queried_prompt_tokens"] - before["queried_prompt_tokens"]
        )
        rows.append(Row("shared-prefix workload", name, out_tokens / elapsed, "out tok/s"))
        rows.append(Row("shared-prefix cache hit rate", name, 100 * hit, "%"))
