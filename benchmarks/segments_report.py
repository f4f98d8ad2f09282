"""bench_segments' report: the run's context lines, one table row per configuration, and the
verdict on the target (the lowest recompute fraction at >= 95% answer match, TTFT >= 2x lower
than exact-prefix caching).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.common import command_line
from benchmarks.host import cpu_line
from benchmarks.segments_passes import Outcome
from benchmarks.segments_quality import Quality, quality
from benchmarks.segments_workload import Workload

TARGET_MATCH = 0.95


TARGET_SPEEDUP = 2.0


def row(o: Outcome, base_p50: float, q: Quality) -> str:
    p50, mean = statistics.median(o.ttft_ms), statistics.fmean(o.ttft_ms)
    counts = "/".join(
        f"{statistics.fmean(c[k] for c in o.counts):.0f}"
        for k in ("reused", "recomputed", "computed")
    )
    return (
        f"| {o.config.name} | {p50:.0f} | {mean:.0f} | {base_p50 / p50:.2f}x "
        f"| {o.throughput:.2f} | {q.answer_match:.0%} | {q.token_agreement:.0%} "
        f"| {q.first_kl:.4f} | {q.kl_k:.4f} | {counts} |"
    )


def verdict(outcomes: list[Outcome], qualities: list[Quality], base_p50: float) -> str:
    passing = sorted(
        (o.config.fraction, statistics.median(o.ttft_ms))
        for o, q in zip(outcomes, qualities)
        if o.config.segmented and q.answer_match >= TARGET_MATCH
    )
    if not passing:
        return f"no recompute fraction reaches {TARGET_MATCH:.0%} answer match: target not met"
    fraction, p50 = passing[0]
    speedup = base_p50 / p50
    met = "target met" if speedup >= TARGET_SPEEDUP else "target not met"
    return (
        f"lowest fraction with >= {TARGET_MATCH:.0%} answer match: {fraction:g}, TTFT p50 "
        f"{speedup:.2f}x lower than exact-prefix caching (target >= {TARGET_SPEEDUP:g}x): {met}"
    )


def report(outcomes: list[Outcome], work: Workload, args: argparse.Namespace) -> None:
    ref = next(o for o in outcomes if o.config.name == "exact prefix")
    base_p50 = statistics.median(ref.ttft_ms)
    qualities = [quality(ref, o, args.kl_tokens) for o in outcomes]
    prompt_tokens = statistics.fmean(len(p.ids) for p in work.measured)
    doc_tokens = statistics.fmean(e - s for p in work.measured for s, e in p.spans)
    print(f"host: {cpu_line()}; torch threads {torch.get_num_threads()}")
    print("command: " + command_line("benchmarks.bench_segments"))
    print(
        f"{len(work.requests)} requests, {len(work.docs)} documents of {doc_tokens:.0f} tokens "
        f"(mean), prompts of {prompt_tokens:.0f} tokens (mean); "
        f"{os.path.basename(args.model_path) if args.model_path else 'default model'}, "
        f"{args.dtype}; "
        f"{args.answer_tokens} answer tokens; reference = exact prefix (full prefill)"
    )
    print(
        f"\n| configuration | TTFT p50 ms | TTFT mean ms | TTFT vs exact prefix | throughput "
        f"req/s | answer match | token agreement | first-token KL | KL <={args.kl_tokens} tokens "
        "| reused/recomputed/computed tokens per request |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for o, q in zip(outcomes, qualities):
        print(row(o, base_p50, q))
    print("\n" + verdict(outcomes, qualities, base_p50))
