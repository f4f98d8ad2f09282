"""Resident memory and ready time of `sglite serve` beside llama.cpp's `llama-server`.

For each GGUF, both servers get the same KV capacity (sglite `--max-total-tokens 16384`,
llama-server `-c 16384 -np 4`) and are started, in alternating order, a FIRST and a SECOND time:

- ready time: wall time from the process start to the first HTTP 200 from `/health` (sglite
  listens only once loaded and warmed up; llama-server answers 503 while loading);
- FIRST start: sglite with a fresh, empty `SGLITE_CACHE_DIR` (tokenizer conversion, GGUF
  index) and `SGLITE_KERNEL_CACHE` (the C kernels, rebuilt with gcc; `--warm-kernels` keeps
  the user's instead); SECOND start: the same directories again. llama-server keeps no on-disk
  cache, so its two starts differ only by chance. The OS page cache holds the GGUF in both (the
  file is read once before the first timed start), for both servers;
- resident memory: after one short completion (16 new tokens) and 2 s idle, the RSS summed over
  the server and all its descendants (sglite's scheduler is a child process), and the PSS sum
  (`smaps_rollup`): a file page mapped by two processes counts once in PSS, twice in RSS.

A server whose tree's RSS passes `--max-rss-gb` (or that leaves less than `--min-available-gb`
of the machine's memory) is killed and reported as "exceeded"; one that exits is "crashed (exit
code -11 SIGSEGV; log PATH)", in the table and the list under it; a missing llama-server is
"missing". No peer is dropped silently. llama-server is the binary `find_llama_server` picks
(`--llama-server`, else the build script's best configuration for the host, else PATH), its
build named in the preamble.

    python -m benchmarks.bench_footprint --model /path/a.gguf [--model NAME ...] [--synthetic-7b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import add_json_option, add_llama_server_option, free_port, git_revision
from benchmarks.footprint_memory import GB
from benchmarks.footprint_servers import (
    IDLE_S,
    KV_TOKENS,
    LLAMA,
    LLAMA_SLOTS,
    NEW_TOKENS,
    SGLITE,
    ServerCommand,
    Start,
    llama_command,
    measure_start,
    sglite_command,
)
from benchmarks.footprint_table import summarize, table
from benchmarks.host import cpu_line
from benchmarks.runners.llama_cpp import find_llama_server, llama_build_line, llama_version


# ---------------------------------------------------------------------------- rounds
def warm_page_cache(path: str) -> None:
    """Read the file once, so both servers find it in the OS page cache."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def first_and_second(
    make: Callable[[Path], ServerCommand], model: str, args: argparse.Namespace
) -> list[Start]:
    """A FIRST and a SECOND start of one server (a second only when the first was ok)."""
    with tempfile.TemporaryDirectory(prefix="footprint-cache-") as cache:
        first = measure_start(make(Path(cache)), model, "first", args)
        if first.status != "ok":
            return [first]
        return [first, measure_start(make(Path(cache)), model, "second", args)]


def bench_model(model: str, llama: str | None, args: argparse.Namespace) -> list[Start]:
    """Every round of both servers on one model, alternating which goes first."""
    warm_page_cache(model)
    name = os.path.basename(model)

    def make_sglite(cache: Path) -> ServerCommand:
        return sglite_command(model, free_port(), cache, args.warm_kernels)

    def make_llama(cache: Path) -> ServerCommand:
        return llama_command(llama or "", model, free_port(), args.threads)

    starts: list[Start] = []
    for r in range(args.rounds):
        order = [(SGLITE, make_sglite), (LLAMA, make_llama)]
        for server, make in order if r % 2 == 0 else order[::-1]:
            if server == LLAMA and llama is None:
                if r == 0:
                    status = "skipped" if args.skip_llama_cpp else "missing"
                    starts.append(Start(name, LLAMA, "first", status, detail=args.llama_why))
                continue
            print(f"  round {r + 1}: {server} on {name} ...", flush=True)
            for s in first_and_second(make, name, args):
                starts.append(s)
                print(f"    {s.kind}: {describe(s)}", flush=True)
    return starts


def describe(s: Start) -> str:
    """One start in a line."""
    if s.status != "ok":
        return f"{s.status} ({s.detail})"
    return (
        f"ready {s.ready_s:.2f} s, RSS {s.rss / GB:.2f} GB (anon {s.anon / GB:.2f}), "
        f"PSS {s.pss / GB:.2f} GB, "
        f"peak {s.peak_rss / GB:.2f} GB, {s.processes} processes"
        + (f"; {s.detail}" if s.detail else "")
    )


# ---------------------------------------------------------------------------- command line
def resolve_model(name: str) -> str:
    """A GGUF path, a known model name (sglite's catalog: `sglite models list`), or "default"."""
    from sglite.runtime.model.catalog import resolve_model_path

    try:
        path = resolve_model_path(None if name == "default" else name)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"--model {name!r}: {exc}") from None
    if not os.path.isfile(path):
        raise SystemExit(f"--model {name!r}: {path} is not a GGUF file (llama-server needs one)")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_footprint", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--model",
        action="append",
        help="GGUF file, known model name or 'default' (repeatable; default: the default model)",
    )
    ap.add_argument(
        "--synthetic-7b",
        action="store_true",
        help="also a synthetic GGUF with Qwen2.5-7B's shapes (benchmarks/"
        "synthetic_gguf.py; written once, ~5 GB)",
    )
    ap.add_argument(
        "--synthetic-dir",
        help="where the synthetic GGUF is kept "
        "(default $SGLITE_CACHE_DIR/synthetic, i.e. ~/.cache/sglite/synthetic)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="first+second starts per server")
    add_llama_server_option(ap)
    ap.add_argument("--skip-llama-cpp", action="store_true", help="measure sglite only")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama-server -t (sglite uses its default: all cores)",
    )
    ap.add_argument(
        "--max-rss-gb",
        type=float,
        default=20.0,
        help="kill a server whose process tree's RSS passes this",
    )
    ap.add_argument(
        "--min-available-gb",
        type=float,
        default=1.5,
        help="kill a server when the machine's MemAvailable falls below this",
    )
    ap.add_argument(
        "--warm-kernels",
        action="store_true",
        help="first starts keep the user's compiled kernels ($SGLITE_KERNEL_CACHE)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for ready")
    add_json_option(ap, "every start and the table's rows")
    return ap.parse_args(argv)


def models_of(args: argparse.Namespace) -> list[str]:
    """The GGUF files to measure, the synthetic 7B last (written first if missing)."""
    models = [resolve_model(m) for m in (args.model or ([] if args.synthetic_7b else ["default"]))]
    if args.synthetic_7b:
        from benchmarks.synthetic_gguf import synthetic_7b

        models.append(str(synthetic_7b(args.synthetic_dir)))
    return models


def preamble(args: argparse.Namespace, llama: str | None) -> list[str]:
    """What was measured and how, printed above the table."""
    cleared = "SGLITE_CACHE_DIR (tokenizer conversion, GGUF index)"
    if not args.warm_kernels:
        cleared += " and SGLITE_KERNEL_CACHE (C kernels compiled with gcc)"
    peer = (
        f"{llama} ({llama_version(llama)}; {llama_build_line(llama)})"
        if llama
        else f"missing: {args.llama_why}"
    )
    return [
        f"host: {cpu_line()}; sglite {git_revision()}",
        f"llama-server: {peer}",
        f"KV capacity {KV_TOKENS} tokens: sglite --max-total-tokens {KV_TOKENS}; llama-server "
        f"-c {KV_TOKENS} -np {LLAMA_SLOTS} -t {args.threads}",
        f"first start: sglite with fresh, empty {cleared}; llama-server has no on-disk cache. "
        "second start: the same cache directories again. OS page cache warm (the GGUF read "
        "once before) for both servers in both starts; Python modules from their compiled "
        "bytecode in both.",
        f"ready: process start to first 200 from /health. memory: after one {NEW_TOKENS}-token "
        f"completion and {IDLE_S:.0f} s idle, summed over the server's process tree, medians "
        "of the second starts; peak RSS: the highest sampled (every 0.1 s, RSS only) over all "
        "starts; anon RSS: RssAnon (RSS less file pages such as the mapped GGUF, and shmem).",
    ]


def main(argv: list[str] | None = None) -> int:
    """Run every model, print the table, save JSON."""
    args = parse_args(argv)
    llama, args.llama_why = (
        (None, "--skip-llama-cpp")
        if args.skip_llama_cpp
        else (find_llama_server(args.llama_server))
    )
    models = models_of(args)
    lines = preamble(args, llama)
    print("\n".join(lines), flush=True)
    starts: list[Start] = []
    for model in models:
        print(f"{os.path.basename(model)}:", flush=True)
        starts += bench_model(model, llama, args)
    rows = summarize(starts)
    print("\n" + "\n".join(lines) + "\n\n" + table(rows))
    for s in starts:
        if s.status != "ok":
            print(f"- {s.model} {s.server} {s.kind} start: {s.status}: {s.detail}")
    if args.json:
        out = {
            "preamble": lines,
            "command": " ".join(sys.argv),
            "rows": [asdict(r) for r in rows],
            "starts": [asdict(s) for s in starts],
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
