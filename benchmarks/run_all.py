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
import signal
import sys
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
    make_parser,
)
from benchmarks.run_all_docs import CHART, chart, report, versions, write_doc
from benchmarks.run_all_table import Missing, percent_text
from benchmarks.runners import ALL_SYSTEMS, QUICK_SYSTEMS, ResultRow, make_system

COMMAND = "benchmarks.run_all"


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
                    f"{row.programs_per_s:.3f} programs/s, hit {percent_text(row.cache_hit_rate)} "
                    f"(ideal {percent_text(row.ideal_hit_rate)})"
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
