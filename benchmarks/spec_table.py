"""bench_spec's table: one workload's result and the Markdown table of them, with llama.cpp's
columns (or why it has none) and its build and configurations' status under it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.common import markdown_table
from benchmarks.spec_llama_peer import Peers
from benchmarks.spec_measure import Tally


@dataclass
class WorkloadResult:
    """One workload's row of the table."""

    name: str
    off: Tally
    on: Tally
    ratio: float  # median over rounds of speculative / plain rate
    ratios: list[float]  # each round's, in order
    per_forward: float  # tokens emitted per forward with speculation
    same: bool  # identical outputs with and without speculation, every round
    ceiling: float | None  # `ngram_ceiling` of the plain answer (None: drafts from the cache)
    peer_off: Tally | None = None  # llama.cpp without speculation
    peer_ceiling: float | None = None  # `ngram_ceiling` of llama.cpp's plain answer
    peer: tuple[str, Tally] | None = None  # llama.cpp's best n-gram configuration


def print_table(args: argparse.Namespace, rows: list[WorkloadResult], llama: Peers) -> None:
    """Markdown table, one row per workload; llama.cpp's columns when it was run (its status
    where it crashed), its build and each configuration's status under the table."""
    with_llama = bool(llama.status)
    heads = [
        "workload", "off (tok/s)", f"{args.algorithm} (tok/s)", "speedup (median)", "acceptance",
        "tokens per forward", "n-gram ceiling", "same output",
    ]  # fmt: skip
    right = {1, 2, 3, 4, 5, 6}
    if with_llama:
        heads += [
            "llama.cpp off", "llama.cpp's n-gram ceiling",
            "llama.cpp best speculation (tok/s, config, acceptance)", "vs llama.cpp's best",
        ]  # fmt: skip
        right |= {8, 9, 11}
    why = "; ".join(f"{s.name} {s.cell()}" for s in llama.status.values() if not s.ok)
    cells = [row_cells(row, len(heads), why) for row in rows]
    print("\n" + markdown_table(heads, cells, right, pad=False))
    for line in llama.summary():
        print(line)


def row_cells(row: WorkloadResult, width: int, peer_status: str = "") -> list[str]:
    """One workload's cells, `width` in all: llama.cpp's when it ran, else `peer_status` (why
    not: its crashes)."""
    ceiling = "-" if row.ceiling is None else f"{row.ceiling:.2f}"
    cells = [
        row.name, f"{row.off.rate:.1f}", f"{row.on.rate:.1f}", f"{row.ratio:.2f}x",
        row.on.acceptance, f"{row.per_forward:.2f}", ceiling, "yes" if row.same else "NO",
    ]  # fmt: skip
    if row.peer is not None and row.peer_off is not None:
        config, best = row.peer
        peer_ceiling = "-" if row.peer_ceiling is None else f"{row.peer_ceiling:.2f}"
        drafted = best.acceptance if best.drafted else "drafted nothing"
        cells += [
            f"{row.peer_off.rate:.1f}", peer_ceiling, f"{best.rate:.1f} ({config}, {drafted})",
            f"{row.on.rate / best.rate:.2f}x",
        ]  # fmt: skip
    elif peer_status and len(cells) < width:
        cells.append(peer_status)
    return cells + ["-"] * (width - len(cells))
