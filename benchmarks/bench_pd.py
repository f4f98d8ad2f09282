"""PD benchmark: disaggregated prefill/decode (one core each) against one co-located server.

Measures the time to first token (TTFT) and the inter-token latency (ITL) of short chat requests
while long prompts arrive, on two setups started once and kept up side by side (an idle server
costs nothing):

- **PD**: a prefill server pinned to CPU 0 and a decode server pinned to CPU 1 (`taskset`, one
  torch thread each) behind the PD router (`python -m sglite.router --pd-disaggregation`,
  unpinned); requests go to the router;
- **co-located**: one ordinary server with two torch threads (both cores); requests go to it.

Each round sends the same seeded open-loop schedule to a setup: short chat requests (a chat
template around a 20-40-token user message, `--short-tokens` output tokens) with Poisson arrivals
at `--short-rate`/s for `--duration` s, and meanwhile long prompts (`--long-prompt-tokens`
tokens, distinct text each, 4 output tokens) at `--long-rate`/s. All go to the native
`/generate` with `"stream": true`, greedy, `ignore_eos` (fixed lengths). Rounds alternate
co-located, PD, co-located, PD... (`--rounds` of each), caches flushed before every round.

Per short request: TTFT (from its scheduled arrival, so client-side queueing at the
`--max-concurrency` cap counts), mean ITL = (last token event - first token event) /
(tokens - 1), and every raw gap between successive token events (its tail is the stall a long
prefill causes: an event carrying k tokens is one gap). Per long request: TTFT. The table
gives p50/p90/p99 of each, aggregated over the rounds, the largest gap seen, completed short
requests/s and generated tokens/s (both over the rounds' wall time, arrival window plus the
tail), and the errors (a request that fails or returns fewer tokens than asked), plus a
PD / co-located ratio row.

    python -m benchmarks.bench_pd                                     # 2 rounds x 30 s each
    python -m benchmarks.bench_pd --duration 5 --rounds 1 --long-prompt-tokens 300  # smoke run

Its peers are sglite's own processes (no llama.cpp). One that exits is reported with
`benchmarks.common.PeerStatus`: at start-up the run stops with "<name>: crashed at start-up
(exit -11 SIGSEGV, log: PATH)" for it (and the others' states); after the rounds, a process that
exited during them is named the same way above the table and in its setup's row.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import tempfile
import time

import httpx

from benchmarks.common import PeerCrashed, PromptMaker, command_line, make_parser, stop_process
from benchmarks.host import cpu_line
from benchmarks.pd_client import RoundResult, run_round
from benchmarks.pd_report import describe_errors, path_line, print_table, summarize, transport
from benchmarks.pd_servers import (
    SETUP_PROCS,
    Proc,
    flush,
    log_problems,
    pd_counters,
    start_all,
    statuses,
    warm_up,
)
from benchmarks.pd_workload import LONG_OUTPUT_TOKENS, schedule

SETUPS = ("co-located", "PD")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    p.add_argument("--short-rate", type=float, default=1.0, help="short requests per second")
    p.add_argument("--short-tokens", type=int, default=32, help="output tokens per short request")
    p.add_argument("--long-rate", type=float, default=0.1, help="long prompts per second")
    p.add_argument("--long-prompt-tokens", type=int, default=1000)
    p.add_argument("--duration", type=float, default=30.0, help="arrival window per round, s")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each setup, alternating")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="each server's KV pool")
    p.add_argument("--server-args", type=shlex.split, default=[],
                   help="extra flags for every server")  # fmt: skip
    return p.parse_args(argv)


def measure(args: argparse.Namespace, urls: dict[str, str], pd_servers: dict[str, str]) -> dict:
    """Alternate the setups' rounds; {setup: [RoundResult]}."""
    maker = PromptMaker(None, args.seed)
    rounds: dict[str, list[RoundResult]] = {s: [] for s in SETUPS}
    for r in range(args.rounds):
        arrivals = schedule(maker, args, r)
        for setup in SETUPS:
            flush(urls[setup])
            before = pd_counters(pd_servers) if setup == "PD" else {}
            result = asyncio.run(run_round(urls[setup], arrivals, args))
            result.setup = setup
            rounds[setup].append(result)
            s = summarize(setup, [result])
            line = f"round {r + 1} {setup}: {len(arrivals)} requests, {result.wall:.1f} s, "
            line += f"short TTFT p50/p99 {s.ttft[0]:.0f}/{s.ttft[2]:.0f} ms, "
            line += f"gap p99 {s.gap[2]:.0f} ms, {s.errors} errors"
            if setup == "PD":
                after = pd_counters(pd_servers)
                line += "; " + ", ".join(f"{k} +{after[k] - before[k]}" for k in after)
            print(line, flush=True)
    return rounds


def main(argv: list[str] | None = None) -> None:
    """Start both setups, alternate their rounds, print the table, stop everything."""
    args = parse_args(argv)
    command = command_line("benchmarks.bench_pd")
    pin = shutil.which("taskset") is not None
    if not pin:
        print("taskset (util-linux) not found: the PD servers run UNPINNED", flush=True)
    log_dir = tempfile.mkdtemp(prefix="sglite-bench-pd-")
    procs: list[Proc] = []
    started = time.monotonic()
    try:
        print(f"load average before: {os.getloadavg()}; logs in {log_dir}", flush=True)
        try:
            start_all(args, pin, log_dir, procs)
        except PeerCrashed as exc:
            print(f"could not start: {exc}", flush=True)
            for status in statuses(procs):
                print(f"- {status.line()}")
            raise SystemExit(1) from None
        colo, prefill, decode, router = procs
        urls = {"co-located": colo.url, "PD": router.url}
        info = httpx.get(colo.url + "/get_server_info", timeout=60).json()
        maker = PromptMaker(None, args.seed + 12345)
        for url in urls.values():
            warm_up(url, maker, args)
        rounds = measure(args, urls, {"prefill": prefill.url, "decode": decode.url})
        after = statuses(procs)  # before the stop below ends them
    finally:
        for p in reversed(procs):  # the router first
            stop_process(p.proc)
    print(f"load average after: {os.getloadavg()}; {time.monotonic() - started:.0f} s in all")
    print(f"\n`{command}`")
    print(f"host: {cpu_line()}; servers: {path_line(info, pin, transport(args))}")
    print(
        f"short: {args.short_rate}/s, chat prompts (20-40-token messages), {args.short_tokens} "
        f"tokens out; long: {args.long_rate}/s, {args.long_prompt_tokens}-token prompts, "
        f"{LONG_OUTPUT_TOKENS} out; {args.duration:.0f} s arrival window; {args.rounds} rounds "
        f"per setup alternating; {args.dtype}, KV pool {args.max_total_tokens} tokens\n"
    )
    for setup in SETUPS:
        describe_errors(setup, rounds[setup])
    problems = log_problems(procs)
    print(f"server/router log lines with warnings or errors: {len(problems)}")
    print(*problems[:10], sep="\n")
    print("processes: " + "; ".join(s.line() for s in after))
    crashed = {
        setup: "; ".join(f"{s.name} {s.cell()}" for s in after if s.name in names and not s.ok)
        for setup, names in SETUP_PROCS.items()
    }
    print_table(
        {s: summarize(s, rounds[s]) for s in SETUPS}, {k: v for k, v in crashed.items() if v}
    )


if __name__ == "__main__":
    main()
