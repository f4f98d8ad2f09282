"""run_all's docs: the section "## The paper's workloads" of docs/benchmarks.md (the run's
machine, versions and method, the table, the targets, the systems' status, notes), written in
place of the old one, and the speedup chart docs/benchmarks_speedup.png.
"""

from __future__ import annotations

import os
import platform
import textwrap
from typing import Any

from benchmarks.common import PeerStatus, git_revision
from benchmarks.run_all_table import TARGET_HF, Missing, speed_ratio, table, targets
from benchmarks.runners import ResultRow

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


SECTION = "## The paper's workloads (`benchmarks/run_all.py`)"


CHART = "benchmarks_speedup.png"


def machine() -> str:
    """nproc, CPU model and memory, from /proc."""
    cpu = platform.processor() or platform.machine()
    mem = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
        with open("/proc/meminfo", encoding="utf-8") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
            mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({cpu}){mem}"


def versions(llama: str | None) -> str:
    """torch, transformers, sglite and llama.cpp versions."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("torch", "transformers", "sglite"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} ?")
    parts.append(f"llama.cpp {llama or 'absent'}")
    return ", ".join(parts)


def report(
    results: list[ResultRow],
    meta: dict[str, Any],
    notes: list[str],
    peers: list[PeerStatus] | None = None,
    missing: Missing | None = None,
) -> str:
    """The docs section: context (an "Incomplete run" line first when a system crashed or could
    not start), the table, the targets, each peer's status, notes."""
    peers = peers or []
    bad = [p for p in peers if not p.ok]
    out = [SECTION, ""]
    if bad:
        out += [
            "**Incomplete run**: "
            + "; ".join(f"{p.name} {p.cell()}" for p in bad)
            + ". Its rows say so below; the figures it has are not comparable to a full run.",
            "",
        ]
    out += [
        f"Command: `{meta['command']}`, run on {meta['date']} (commit `{git_revision()}`), "
        f"{meta['elapsed']:.0f} s in all. Machine: {machine()}; load average "
        f"{meta['load'][0]:.1f} at start, {meta['load'][1]:.1f} at end. Versions: "
        f"{meta['versions']}. Systems: " + "; ".join(meta["systems"]) + ".",
        "",
        "Each system runs every workload's programs through sglite's interpreter (program logic "
        "in Python, one model call per `gen`/`select`), all programs at once as `run_batch` "
        "does, greedy, on a cold cache. programs/s = all programs / wall time of the batch "
        "(programs failing the workload's check count too; `ok` says how many passed); out "
        "tok/s counts the generated texts re-tokenized with the model's tokenizer (one rule for "
        "every system); p50 latency is the median of each program's own wall time; cache hit "
        "is the runtime's own counter over the run (sglite: `cached_prompt_tokens` / "
        "`queried_prompt_tokens` of `get_server_info()`; llama.cpp: `timings.cache_n` / "
        "(`cache_n` + `prompt_n`) of its answers; transformers has no cache); ideal hit is the "
        "share of prompt tokens an infinite prefix cache could reuse over the calls the system "
        "received (`benchmarks/ideal_cache.py`; for sglite these include its pre-caching fills "
        "and `select`'s prefix probes). Speedups are ratios of programs/s in this run. "
        "transformers: concurrent `gen` calls with equal sampling parameters micro-batched into "
        "one left-padded `generate`, `select` by scoring each choice's tokens, no constrained "
        "decoding (regex / JSON-schema outputs unconstrained, so checks may fail). llama.cpp: "
        "`/completion` with `cache_prompt`, regexes as GBNF grammars, `json_schema` native, "
        "`select` as one forced-grammar call per choice in turn with `n_probs` (llama-server "
        "returns no prompt logprobs).",
        "",
        table(results, missing),
        "",
        "Targets:",
        "",
        *targets(results, missing),
    ]
    if peers:
        out += ["", "Systems' status:", "", *(f"- {p.line()}" for p in peers)]
    if notes:
        out += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    if os.path.exists(os.path.join(DOC, CHART)):
        out += ["", f"![speedups]({CHART})"]
    # Prose wrapped like the rest of the docs; table rows and list items stay one line each.
    out = [
        x if x.startswith(("|", "- ", "#")) else textwrap.fill(x, 100, break_on_hyphens=False)
        for x in out
    ]
    return "\n".join(out) + "\n"


def write_doc(section: str, path: str = os.path.join(DOC, "benchmarks.md")) -> None:
    """Replace the section in `path` (or insert it before the first other section)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        end = len(text) if end < 0 else end + 1
        text = text[:start] + section + ("\n" if end < len(text) else "") + text[end:]
    else:
        first = text.find("\n## ")
        first = len(text) if first < 0 else first + 1
        text = text[:first] + section + "\n" + text[first:]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def chart(results: list[ResultRow], path: str = os.path.join(DOC, CHART)) -> bool:
    """Bar chart of sglite's speedups (log scale); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[chart] skipped: pip install matplotlib (the `bench` extra)")
        return False
    by = {(r.workload, r.system): r for r in results}
    ours = [r for r in results if r.system == "sglite"]
    series = {b: [speed_ratio(by, r, b) for r in ours] for b in ("transformers", "llama.cpp")}
    series = {b: v for b, v in series.items() if any(x is not None for x in v)}
    if not ours or not series:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(ours) + 2), 4.5))
    width = 0.8 / len(series)
    for k, (base, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(ours))]
        bars = ax.bar(xs, [v or 0 for v in values], width, label=f"sglite vs {base}")
        labels = ["" if v is None else f"{v:.1f}x" for v in values]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(TARGET_HF, color="gray", linestyle="--", linewidth=0.8, label="5x target")
    ax.set_yscale("log")
    ax.set_xticks(range(len(ours)), [r.workload for r in ours], rotation=30, ha="right")
    ax.set_ylabel("speedup in programs/s (log)")
    ax.set_title("sglite vs transformers and llama.cpp, " + machine().split(" (")[0])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
