"""run_all's table and targets: the Markdown table of every (workload, system) row with its
speedups vs transformers and llama.cpp (or why a system has no figures), and MET / MISSED for
each target.
"""

from __future__ import annotations

from benchmarks.common import markdown_table
from benchmarks.runners import ALL_SYSTEMS, ResultRow

TARGET_HF, TARGET_HIT_POINTS = 5.0, 5.0


def percent_text(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def speed_ratio(rows: dict[tuple[str, str], ResultRow], r: ResultRow, base: str) -> float | None:
    other = rows.get((r.workload, base))
    if other is None or other.programs_per_s <= 0 or r.system == base:
        return None
    return r.programs_per_s / other.programs_per_s


# (workload, system) -> why that system has no row for it (`PeerStatus.cell()`).
Missing = dict[tuple[str, str], str]


def table(results: list[ResultRow], missing: Missing | None = None) -> str:
    """The Markdown table of every row; a (workload, system) in `missing` gets a row that says
    why it has no figures (a crash, with its exit code and log) instead of none."""
    missing = missing or {}
    by = {(r.workload, r.system): r for r in results}
    workloads = list(dict.fromkeys([r.workload for r in results] + [w for w, _ in missing]))
    order = {name: i for i, name in enumerate(ALL_SYSTEMS)}
    keys = [(r.workload, r.system) for r in results] + [k for k in missing if k not in by]
    keys.sort(key=lambda k: (workloads.index(k[0]), order.get(k[1], len(order))))
    heads = ["workload", "system", "ok", "programs/s", "out tok/s", "p50 latency s", "cache hit",
             "ideal hit", "vs transformers", "vs llama.cpp"]  # fmt: skip
    rows = []
    for key in keys:
        r = by.get(key)
        if r is None:
            rows.append([*key, missing[key], *["-"] * (len(heads) - 3)])
            continue
        vs = [speed_ratio(by, r, b) for b in ("transformers", "llama.cpp")]
        cells = [
            r.workload, r.system, f"{r.ok}/{r.programs}", f"{r.programs_per_s:.3f}",
            f"{r.output_tok_per_s:.1f}", f"{r.p50_latency_s:.1f}", percent_text(r.cache_hit_rate),
            percent_text(r.ideal_hit_rate), *("-" if v is None else f"{v:.2f}x" for v in vs),
        ]  # fmt: skip
        rows.append(cells)
    return markdown_table(heads, rows, right=range(2, len(heads)), pad=False)


def targets(results: list[ResultRow], missing: Missing | None = None) -> list[str]:
    """One line per target and workload: MET / MISSED (or why it could not be judged)."""
    missing = missing or {}
    by = {(r.workload, r.system): r for r in results}
    lines = []

    def unmeasured(workload: str, system: str) -> str:
        why = missing.get((workload, system))
        return f"not measured: {system} {why}" if why else "not measured"

    for r in (x for x in results if x.system == "sglite"):
        hf = speed_ratio(by, r, "transformers")
        if r.shared_prefix:
            if hf is None:
                lines.append(
                    f"- {r.workload}: >= {TARGET_HF:.0f}x transformers: "
                    + unmeasured(r.workload, "transformers")
                )
            else:
                verdict = "MET" if hf >= TARGET_HF else "MISSED"
                lines.append(
                    f"- {r.workload}: >= {TARGET_HF:.0f}x transformers: {verdict} ({hf:.2f}x)"
                )
        ll = speed_ratio(by, r, "llama.cpp")
        if ll is None:
            lines.append(
                f"- {r.workload}: ahead of llama.cpp: {unmeasured(r.workload, 'llama.cpp')}"
            )
        else:
            lines.append(
                f"- {r.workload}: ahead of llama.cpp: {'MET' if ll > 1 else 'MISSED'} ({ll:.2f}x)"
            )
        if r.cache_hit_rate is not None:
            gap = 100 * (r.ideal_hit_rate - r.cache_hit_rate)
            verdict = "MET" if gap <= TARGET_HIT_POINTS else "MISSED"
            lines.append(
                f"- {r.workload}: cache hit within {TARGET_HIT_POINTS:.0f} points of ideal: "
                f"{verdict} ({percent_text(r.cache_hit_rate)} vs {percent_text(r.ideal_hit_rate)})"
            )
    return lines
