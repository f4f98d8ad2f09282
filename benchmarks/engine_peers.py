"""The peers bench_engine measures sglite against: llama.cpp (`llama-bench` prefill and decode,
at depth too, with a `--repack 0` fallback when it crashes; `llama-server` on the shared-prefix
workload) and transformers (prefill and batch-1 decode on the same GGUF)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.common import PeerStatus
from benchmarks.engine_rows import Row, status_row
from benchmarks.engine_workloads import (
    LONG_CONTEXT,
    LONG_DECODE,
    best_time,
    exact_prompt_ids,
    shared_prefix_workload,
)

# ------------------------------------------------------------------------------ llama.cpp
LLAMA_BENCH_METRICS = ("prefill 1000 tokens", "batch-1 decode", LONG_DECODE)
REPACK_FALLBACK = "fallback: --repack 0, the default crashed"


def bench_llama_cpp(args: argparse.Namespace, rows: list[Row]) -> list[str]:
    """llama-bench prefill/decode and llama-server on the shared-prefix workload, with the build
    `find_llama_server` picks (named in the rows); a run that crashes gets a status row and a
    note (returned), a fallback configuration is named as one."""
    from benchmarks.runners.llama_cpp import llama_binaries, llama_build, llama_build_line

    bench, server = llama_binaries(args.llama_server)
    if bench is None:
        return ["llama.cpp not found (bash benchmarks/build_llama_cpp.sh): not measured"]
    threads = str(args.threads)
    build = llama_build(bench)
    args.llama_build = llama_build_line(bench)
    name = f"llama.cpp {build}"
    notes: list[str] = []
    extra: tuple[str, ...] = ()
    results, failure = _llama_bench(bench, args.model, threads, ())
    if results is None:
        # Its AMX path crashes on some CPUs; the script's build avoids it, another may not.
        for metric in LLAMA_BENCH_METRICS:
            rows.append(status_row(metric, name, failure))
        notes.append(f"llama.cpp {failure.line()}; measured again with --repack 0")
        extra = ("--repack", "0")
        results, failure = _llama_bench(bench, args.model, threads, extra)
        name = f"{name} ({REPACK_FALLBACK})"
    if results is None:
        for metric in LLAMA_BENCH_METRICS:
            rows.append(status_row(metric, name, failure))
        return [*notes, f"llama.cpp with --repack 0 {failure.line()}"]
    for result in results:
        if result.get("n_prompt"):
            rows.append(Row("prefill 1000 tokens", name, result["avg_ts"], "tok/s"))
        elif result.get("n_gen"):
            metric = LONG_DECODE if result.get("n_depth") else "batch-1 decode"
            rows.append(Row(metric, name, result["avg_ts"], "tok/s"))
    if failure is not None:  # the run at depth crashed after the first succeeded
        rows.append(status_row(LONG_DECODE, name, failure))
        notes.append(f"llama.cpp at depth {LONG_CONTEXT} {failure.line()}")
    if server is None or args.quick:
        return notes
    return notes + _llama_server_shared_prefix(args, rows, server, build, extra)


def _llama_server_shared_prefix(
    args: argparse.Namespace, rows: list[Row], server: str, build: str, extra: tuple[str, ...]
) -> list[str]:
    """llama-server (16 slots, `cache_prompt`) on the shared-prefix workload: its rows, or
    status rows and a note when it crashes or its calls fail."""
    from benchmarks.common import PeerCrashed, post_json, stop_process
    from benchmarks.runners.llama_cpp import llama_failure, start_llama_server
    from sglite.runtime.model.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    work = shared_prefix_workload(tok, args.requests)
    server_extra = ("--no-repack",) if extra else ()
    name = f"llama.cpp server {build} (16 slots)" + (f" ({REPACK_FALLBACK})" if extra else "")
    metrics = ("shared-prefix workload", "shared-prefix cache hit rate")
    proc = None
    with tempfile.NamedTemporaryFile(
        "w", suffix=".log", prefix="llama-server-", delete=False
    ) as log:
        try:
            proc, base = start_llama_server(
                server, args.model, args.threads, 16, 2048, log, server_extra
            )
            body = {"temperature": 0, "n_predict": args.new_tokens, "ignore_eos": True}
            body["cache_prompt"] = True

            def one(ids: list[int]) -> dict:
                return post_json(base + "/completion", {**body, "prompt": ids})

            start = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(one, work))
            elapsed = time.perf_counter() - start
        except (PeerCrashed, OSError, ValueError) as exc:
            status = llama_failure(server, proc, log.name, exc)
            for metric in metrics:
                rows.append(status_row(metric, name, status))
            return [f"llama.cpp server {status.line()}"]
        finally:
            if proc is not None:
                stop_process(proc, timeout=30)
    os.unlink(log.name)
    out_tokens = sum(a["timings"]["predicted_n"] for a in answers)
    cached = sum(a["timings"].get("cache_n", 0) for a in answers)
    prompt = sum(a["timings"].get("cache_n", 0) + a["timings"]["prompt_n"] for a in answers)
    rows.append(Row(metrics[0], name, out_tokens / elapsed, "out tok/s"))
    rows.append(Row(metrics[1], name, 100 * cached / prompt, "%"))
    return []


def _llama_bench(
    bench: str, model: str, threads: str, extra: tuple[str, ...]
) -> tuple[list[dict] | None, PeerStatus | None]:
    """llama-bench pp1000 / tg128, then tg128 after LONG_CONTEXT tokens (`-d`), on the GGUF:
    (results, None); (None, the crash) when the first run fails; (the first's results, the
    crash) when only the second does. A failed run's output is kept in a log the status names."""
    from benchmarks.runners.llama_cpp import llama_status

    runs = [
        ["-p", "1000", "-n", "128"],
        ["-p", "0", "-n", "128", "-d", str(LONG_CONTEXT)],
    ]
    results: list[dict] = []
    for i, run in enumerate(runs):
        cmd = [bench, "-m", model, *run, "-t", threads, *extra]
        done = subprocess.run([*cmd, "-o", "json"], capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            with tempfile.NamedTemporaryFile(
                "w", prefix="llama-bench-", suffix=".log", delete=False
            ) as log:
                log.write(f"$ {' '.join(cmd)} -o json\n{done.stdout}\n{done.stderr}")
            status = llama_status(bench, "crashed", exit_code=done.returncode, log=log.name)
            status.name = f"llama-bench {' '.join(run)}"
            print(status.line(), flush=True)
            return (None if i == 0 else results), status
        results += json.loads(done.stdout)
    return results, None


# ------------------------------------------------------------------------------ transformers
def bench_transformers(args: argparse.Namespace, rows: list[Row], dtype: torch.dtype) -> None:
    """transformers on the same GGUF weights, same thread count: prefill and batch-1 decode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(args.model)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype).eval()
    name = f"transformers {str(dtype).replace('torch.', '')}"
    prompt = exact_prompt_ids(tok, 1000, seed=0)
    with torch.inference_mode():
        model(torch.tensor([prompt[:100]]))
        t = best_time(lambda: model(torch.tensor([prompt])), args.repeats)
        rows.append(Row("prefill 1000 tokens", name, 1000 / t, "tok/s"))
        short = torch.tensor([exact_prompt_ids(tok, 16, seed=3)])
        n_dec = args.decode_tokens
        kw = {"do_sample": False, "pad_token_id": tok.eos_token_id}
        first = best_time(
            lambda: model.generate(short, max_new_tokens=1, min_new_tokens=1, **kw), 1
        )
        total = best_time(
            lambda: model.generate(short, max_new_tokens=n_dec + 1, min_new_tokens=n_dec + 1, **kw),
            1,
        )
        rows.append(Row("batch-1 decode", name, n_dec / (total - first), "tok/s"))
