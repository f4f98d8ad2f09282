"""The paper's workloads on every system: one table, the targets, docs/benchmarks.md and a chart.

Runs each workload of `benchmarks/programs/` on each system of `benchmarks/runners/` (one model
loaded at a time: a system starts, runs every workload on a cold cache, stops), prints one
Markdown table (workload x system: programs/s, output tokens/s, p50 program latency, cache hit
rate from the runtime's counters, ideal hit rate, speedup of programs/s vs transformers and vs
llama.cpp), says MET / MISSED for each target, writes the section "## The paper's workloads"
of `docs/benchmarks.md` and saves `docs/benchmarks_speedup.png`.

    python -m benchmarks.run_all                 # every system, full sizes
    python -m benchmarks.run_all --quick         # sglite, transformers, llama.cpp; small sizes
    python -m benchmarks.run_all --quick --workloads mmlu --num-requests 2 --no-write

Targets: sglite >= 5x transformers on workloads with shared prefixes, ahead of
llama.cpp on each workload, cache hit rate within 5 points of the ideal.

llama.cpp is the build `runners.llama_cpp.find_llama_server` picks (`--llama-server PATH`, else
the one `benchmarks/build_llama_cpp.sh` built, its best configuration for the host, else PATH);
the section's Systems line names it (the script's `BUILD` record). A system that cannot start or
crashes during a workload keeps its rows: the table says "crashed at start-up (exit -11 SIGSEGV,
log: PATH)" (or why it failed) where its figures would be, the targets name it, and the section
opens with "Incomplete run", so the docs never read as complete when a peer crashed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import textwrap
import time
import traceback
from dataclasses import asdict
from typing import Any

from benchmarks.common import (
    PeerCrashed,
    PeerStatus,
    add_json_option,
    add_llama_server_option,
    command_line,
    git_revision,
    make_parser,
    markdown_table,
)
from benchmarks.runners import ALL_SYSTEMS, QUICK_SYSTEMS, ResultRow, make_system

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
SECTION = "## The paper's workloads (`benchmarks/run_all.py`)"
CHART = "benchmarks_speedup.png"
COMMAND = "benchmarks.run_all"
TARGET_HF, TARGET_HIT_POINTS = 5.0, 5.0


# ---------------------------------------------------------------------------- table
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(rows: dict[tuple[str, str], ResultRow], r: ResultRow, base: str) -> float | None:
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
        vs = [_ratio(by, r, b) for b in ("transformers", "llama.cpp")]
        cells = [
            r.workload, r.system, f"{r.ok}/{r.programs}", f"{r.programs_per_s:.3f}",
            f"{r.output_tok_per_s:.1f}", f"{r.p50_latency_s:.1f}", _pct(r.cache_hit_rate),
            _pct(r.ideal_hit_rate), *("-" if v is None else f"{v:.2f}x" for v in vs),
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
        hf = _ratio(by, r, "transformers")
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
        ll = _ratio(by, r, "llama.cpp")
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
                f"{verdict} ({_pct(r.cache_hit_rate)} vs {_pct(r.ideal_hit_rate)})"
            )
    return lines


# ---------------------------------------------------------------------------- report
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


def busy_cores(seconds: float = 1.0) -> float | None:
    """How many cores other work keeps busy now (from /proc/stat over `seconds`), or None."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = max(1, total1 - total0)
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total)


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
    series = {b: [_ratio(by, r, b) for r in ours] for b in ("transformers", "llama.cpp")}
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


# ---------------------------------------------------------------------------- driver
def start_failure(name: str, system: Any, exc: Exception) -> PeerStatus:
    """A system that could not start: its crash (exit code, log, build) or the error."""
    if isinstance(exc, PeerCrashed):
        return PeerStatus(**{**vars(exc.status), "name": name})
    build = getattr(system, "build", "")
    return PeerStatus(name, "failed", reason=f"{type(exc).__name__}: {str(exc)[:200]}", build=build)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    quick = f"systems {','.join(QUICK_SYSTEMS)}; each workload's quick size"
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--workloads", default=None, help="comma-separated (default: all)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated from {','.join(ALL_SYSTEMS)}")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=None, help="programs per workload")
    add_llama_server_option(p)
    p.add_argument("--threads", type=int, default=None, help="threads per system (all cores)")
    p.add_argument("--hf-dtype", default="auto", help="transformers dtype (auto: as sglite's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="do not touch docs/")
    add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[ResultRow]:
    """Run the suite; returns the rows."""
    import json

    from benchmarks.programs import WORKLOADS, get_workload
    from benchmarks.runners.llama_cpp import find_llama_server

    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every system's `stop()` ends its server processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    print(f"command: {command_line(COMMAND)}", flush=True)
    busy = busy_cores()
    if busy is not None and busy > 0.3:
        print(
            f"WARNING: {busy:.1f} cores already busy: with other work on the cores, 2-thread "
            "torch and llama.cpp stall (their threads spin-wait for each other); numbers will "
            "not compare",
            flush=True,
        )
    names = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    workloads = [get_workload(n.strip()) for n in names if n.strip()]
    systems = args.systems.split(",") if args.systems else (
        QUICK_SYSTEMS if args.quick else ALL_SYSTEMS
    )  # fmt: skip
    llama, why = find_llama_server(args.llama_server)
    results: list[ResultRow] = []
    notes: list[str] = []
    described: list[str] = []
    peers: list[PeerStatus] = []  # one per system: how it fared
    missing: Missing = {}
    llama_version = None
    for name in (s.strip() for s in systems if s.strip()):
        if name == "llama.cpp" and llama is None:
            print(f"[llama.cpp] skipped: {why}", flush=True)
            peers.append(PeerStatus(name, "skipped", reason=why))
            missing.update({(w.name, name): f"skipped ({why})" for w in workloads})
            continue
        system = None
        try:
            system = make_system(name, args.threads, llama, args.hf_dtype)
            start = time.perf_counter()
            system.start()
            system.warm_up()
        except Exception as exc:  # one system that cannot start never stops the suite
            status = start_failure(name, system, exc)
            print(f"[{name}] could not start: {status.cell()}", flush=True)
            if not isinstance(exc, PeerCrashed):
                traceback.print_exc()
            if system is not None:
                described.append(f"{name} = {system.description}")
                llama_version = getattr(system, "version", llama_version)
                system.stop()
            peers.append(status)
            missing.update({(w.name, name): status.cell() for w in workloads})
            continue
        status = PeerStatus(name, build=getattr(system, "build", ""))
        llama_version = getattr(system, "version", llama_version)
        dtype = getattr(system, "resolved_dtype", "")
        extra = f" ({dtype})" if dtype and dtype not in system.description else ""
        described.append(f"{name} = {system.description}{extra}")
        print(f"[{name}] started in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            for w in workloads:
                n = args.num_requests or (
                    w.quick_num_requests if args.quick else w.default_num_requests
                )
                try:
                    row = system.run(w, n, args.seed)
                except PeerCrashed as exc:
                    print(f"[{name}/{w.name}] {exc}", flush=True)
                    status = PeerStatus(**{**vars(exc.status), "name": name})
                    missing[(w.name, name)] = exc.status.cell()
                    continue
                except Exception as exc:
                    print(f"[{name}/{w.name}] failed: {exc}", flush=True)
                    traceback.print_exc()
                    notes.append(f"{name} / {w.name} failed: {exc}")
                    missing[(w.name, name)] = f"failed ({type(exc).__name__}: {str(exc)[:120]})"
                    continue
                results.append(row)
                print(
                    f"[{name}/{w.name}] {row.ok}/{row.programs} ok, {row.wall_s:.1f} s, "
                    f"{row.programs_per_s:.3f} programs/s, hit {_pct(row.cache_hit_rate)} "
                    f"(ideal {_pct(row.ideal_hit_rate)})"
                    + (f"; e.g. {row.errors[0]}" if row.errors else ""),
                    flush=True,
                )
        finally:
            system.stop()
            peers.append(status)
            notes.extend(system.notes)
            sizes = getattr(system, "batch_sizes", None)
            if sizes:
                notes.append(
                    f"{name}: mean rows per model call (micro-batching): "
                    + ", ".join(f"{w} {v:.1f}" for w, v in sizes.items())
                )
    elapsed = time.perf_counter() - t0
    meta = {
        "command": command_line(COMMAND),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed": elapsed,
        "load": (load0, os.getloadavg()[0]),
        "versions": versions(llama_version),
        "systems": described,
    }
    if not args.no_write and results:
        chart(results)
    text = report(results, meta, notes, peers, missing)
    print()
    print(text)
    if not args.no_write and results:
        write_doc(text)
        print(f"wrote docs/benchmarks.md and docs/{CHART}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
