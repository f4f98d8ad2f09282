"""JSON decoding benchmark (the SGLang paper's JSON workload): extract a multi-field JSON object
from each of `--num-docs` documents, constrained by a JSON schema or by the equivalent regex.

Documents are synthetic and deterministic (no download): encyclopedia-style paragraphs about
invented cities (name, country, population, founding year, mayor) and character profiles (name,
age, occupation, hometown, hobby), alternating, each with distractor names and numbers. Every
prompt is a chat turn with one worked example (shared by all documents of a kind, so it is a
cached prefix) followed by the document.

Configurations, each a fresh engine started, measured and shut down in turn (so none competes
with another for the cores), all greedy with the same dtype, threads and `--max-new-tokens`:
- token-by-token: sglite with `disable_jump_forward=True`, the baseline of every ratio;
- exact jump-forward: the default engine (forced tokens drafted and verified in one forward;
  greedy outputs must equal token-by-token's, the `differ` column counts those that do not);
- retokenize jump-forward: SGLang's original (forced text retokenized, appended unverified);
- unconstrained: the same prompts without a constraint (valid = parses and fits the schema);
- llama.cpp: `llama-server` on the same GGUF with grammar-constrained sampling (`json_schema` /
  a GBNF `grammar` equivalent to the regex on `/completion`), `-np` parallel slots driven
  concurrently; run when a binary is found (`--llama-server PATH`, else the best configuration
  for the host that `benchmarks/build_llama_cpp.sh` built, else on PATH; its build is printed
  beside the table). A llama-server that crashes gets a row saying "crashed at start-up (exit
  -11 SIGSEGV, log: PATH)" per variant and a line in the summary. Note
  that llama.cpp computes in the GGUF's quantized format and its JSON schemas allow free
  whitespace, while sglite dequantizes (bf16 or fp32) and uses fixed separators.

Per configuration and variant: wall time of the whole batch (engine start and warm-up
excluded), documents/s, output tokens/s, CPU seconds of the model process (scheduler or
llama-server; less sensitive than wall time to other jobs on a shared machine), forward passes
(server counters), drafted and accepted jump-forward tokens, outputs valid under the constraint
(`jsonschema` or `re.fullmatch`), outputs that parse as JSON, extracted values equal to the
document's, and outputs that differ from token-by-token (by text / by token ids). Ratios are
against token-by-token in the same run; quote those. `--repeats N` keeps the best of N batches.

Run: python -m benchmarks.bench_json [--quick] [--num-docs 64] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict

from benchmarks.common import (
    add_json_option,
    add_llama_server_option,
    command_line,
    git_revision,
    make_parser,
)
from benchmarks.json_documents import make_docs
from benchmarks.json_results import Run, compare, score
from benchmarks.json_runners import bench_llama, bench_sglite
from benchmarks.json_table import LABELS, table
from benchmarks.runners.llama_cpp import find_llama_server, llama_build_line

COMMAND = "benchmarks.bench_json"
VARIANTS = ("schema", "regex")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    p.add_argument("--num-docs", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="8 documents: a smoke run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None,
                   help="sglite torch threads, llama-server -t (default: all cores)")  # fmt: skip
    p.add_argument("--grammar-backend", default="llguidance")
    p.add_argument("--variants", default="schema,regex", help="comma-separated: schema, regex")
    p.add_argument("--configs", default="none,exact,retokenize,free,llama",
                   help="comma-separated, run in this order: none (token-by-token), exact, "
                        "retokenize, free (unconstrained), llama")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="time each batch N times, keep the best wall and CPU time")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="document generator seed")
    add_llama_server_option(p)
    p.add_argument("--llama-parallel", type=int, default=None,
                   help="llama-server -np slots (default: min(num docs, 64))")  # fmt: skip
    p.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    add_json_option(p, "every run (with outputs)")
    args = p.parse_args(argv)
    args.resolved_dtype = None
    if args.quick:
        args.num_docs = 8
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for c in args.configs:
        if c not in LABELS:
            p.error(f"unknown configuration {c!r}; choose from {', '.join(LABELS)}")
    return args


def find_llama(args: argparse.Namespace) -> str | None:
    """The llama-server binary when the llama configuration is asked for (None: skipped)."""
    if "llama" not in args.configs:
        return None
    llama, why = find_llama_server(args.llama_server)
    if llama is None and args.llama_server:
        raise SystemExit(why)
    if llama is None:
        print(f"[llama] will be skipped: {why}")
    return llama


def main(argv: list[str] | None = None) -> None:
    """Run each configuration in turn and print the table."""
    args = parse_args(argv)
    print(f"command: {command_line(COMMAND)}", flush=True)
    docs = make_docs(args.num_docs, args.seed)
    llama = find_llama(args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    runs: list[Run] = []
    for config in args.configs:
        if config == "llama":
            if llama is None:
                print("[llama] skipped: no llama-server binary")
                continue
            print(f"[llama] {llama} ({llama_build_line(llama)}), {len(docs)} documents ...")
            runs += bench_llama(llama, args, docs)
        else:
            print(f"[{config}] {LABELS[config]}, {len(docs)} documents ...", flush=True)
            runs += bench_sglite(config, args, docs)
    base = {r.variant: r for r in runs if r.config == "none"}
    for r in (r for r in runs if not r.status):
        score(r, docs)
        if r.config in ("exact", "retokenize") and r.variant in base:
            compare(r, base[r.variant], docs)

    import torch

    dtype = args.dtype if args.dtype != "auto" else f"auto = {args.resolved_dtype or '?'}"
    print()
    print(f"command: {command_line(COMMAND)}")
    print(
        f"commit {git_revision()}; machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; dtype {dtype}; "
        f"{args.num_docs} documents, max_new_tokens {args.max_new_tokens}, greedy; "
        f"grammar backend {args.grammar_backend}; load average {load:.1f} at start, "
        f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.1f} at end"
    )
    print(table(runs))
    if llama is not None and "llama" in args.configs:
        crashes = [r for r in runs if r.config == "llama" and r.status]
        state = "; ".join(f"{r.variant}: {r.status}" for r in crashes) or "ok"
        print(f"llama.cpp: {llama}, build {llama_build_line(llama)}: {state}")
    print(
        "valid: fits the constraint (jsonschema / re.fullmatch; for unconstrained, the schema). "
        "fields right: extracted values equal to the document's. differ: outputs unlike "
        "token-by-token's (exact must be 0). tbt = token-by-token."
    )
    exact = [r for r in runs if r.config == "exact" and r.variant in base]
    for r in exact:
        b = base[r.variant]
        ratio = (r.docs / r.wall_s) / (b.docs / b.wall_s)
        verdict = "met" if ratio >= 1.5 else "NOT met"
        cpu = f", {b.cpu_s / r.cpu_s:.2f}x less CPU time" if r.cpu_s and b.cpu_s else ""
        print(
            f"target exact jump-forward >= 1.5x token-by-token throughput ({r.variant}): "
            f"{ratio:.2f}x, {verdict}{cpu}"
        )
    for r in runs:
        for note in r.notes:
            print("WARNING: " + note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)


if __name__ == "__main__":
    main()
