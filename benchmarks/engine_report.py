"""bench_engine's report: the Markdown table of every figure, each speed target checked against
the machine's limits and the peers' figures, and what could not be measured."""

from __future__ import annotations

import argparse
import os
import platform

import torch

from benchmarks.engine_rows import Row
from benchmarks.engine_sglite import BANDWIDTH_SHARE
from benchmarks.engine_workloads import LONG_CONTEXT, LONG_DECODE


def _value(rows: list[Row], metric: str, system_prefix: str) -> float | None:
    values = [
        r.value
        for r in rows
        if r.metric == metric and r.system.startswith(system_prefix) and not r.status
    ]
    return max(values) if values else None


def _why_missing(rows: list[Row], metric: str, system_prefix: str) -> str:
    """Why a system has no figure for a metric, from its status rows ("" if none says)."""
    cells = [
        f"{r.system} {r.status}"
        for r in rows
        if r.metric == metric and r.system.startswith(system_prefix) and r.status
    ]
    return "; ".join(cells)


def targets(rows: list[Row], machine: dict[str, float]) -> list[str]:
    """Each speed target with the figures it compares and whether it is met (sglite's best
    format against llama.cpp's best build and transformers' best dtype)."""
    lines = []

    def check(label: str, ours: float | None, bar: float | None, how: str, why: str = "") -> None:
        if ours is None or bar is None:
            because = f": {why}" if why and bar is None else ""
            lines.append(f"- {label}: not measured in this run ({how}){because}")
            return
        status = "MET" if ours >= bar else "MISSED"
        lines.append(f"- {label}: {status} ({ours:,.1f} vs target {bar:,.1f}; {how})")

    decode = _value(rows, "batch-1 decode", "sglite")
    check(
        "batch-1 decode >= 85% of the bandwidth limit",
        _value(rows, BANDWIDTH_SHARE, "sglite"),
        85.0,
        "% of the read rate measured before and after the decode run; the limit from the "
        f"start's read rate: {machine['decode_limit']:,.1f} tok/s",
    )
    llama = _value(rows, "batch-1 decode", "llama.cpp")
    check(
        "batch-1 decode >= 1.1x llama.cpp",
        decode,
        llama and 1.1 * llama,
        "tg128",
        _why_missing(rows, "batch-1 decode", "llama.cpp"),
    )
    llama_long = _value(rows, LONG_DECODE, "llama.cpp")
    check(
        f"batch-1 decode at {LONG_CONTEXT}-token context >= 1.25x llama.cpp",
        _value(rows, LONG_DECODE, "sglite"),
        llama_long and 1.25 * llama_long,
        f"tg128 at depth {LONG_CONTEXT}",
        _why_missing(rows, LONG_DECODE, "llama.cpp"),
    )
    prefill = _value(rows, "prefill 1000 tokens", "sglite")
    check(
        "prefill >= 70% of the matmul roofline (bf16, or float32 where faster)",
        prefill,
        0.7 * machine["prefill_roofline"],
        f"roofline {machine['prefill_roofline']:,.0f} tok/s",
    )
    hf = _value(rows, "prefill 1000 tokens", "transformers")
    check("prefill >= 2x transformers (its best dtype)", prefill, hf and 2 * hf, "")
    check(
        "32 concurrent decode >= 50% of the roofline",
        _value(rows, "32 concurrent decode", "sglite"),
        0.5 * machine["batch32_roofline"],
        f"roofline {machine['batch32_roofline']:,.0f} tok/s",
    )
    return lines


def report(
    rows: list[Row], machine: dict[str, float], args: argparse.Namespace, notes: list[str]
) -> str:
    """Markdown: the table of every figure, the targets, then what could not be measured."""
    lines = [
        f"model: {os.path.basename(args.model)}",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} threads, torch {torch.__version__}",
    ]
    if getattr(args, "llama_build", None):
        lines.append(f"llama.cpp: {args.llama_build}")
    lines += ["", "| metric | system | value | unit |", "|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r.metric} | {r.system} | {r.value_cell()} | {r.unit} |")
    lines += ["", "Targets:", "", *targets(rows, machine)]
    if notes:
        lines += ["", "Not measured or crashed:", "", *(f"- {note}" for note in notes)]
    text = "\n".join(lines)
    print(text)
    return text
