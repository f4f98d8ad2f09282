"""Router benchmark: cache_aware vs round_robin vs least_load over two sglite workers.

Starts two workers (`python -m sglite.launch_server`, one torch thread each so they do not fight
over the cores) and, for each policy, a router in front of them; flushes the workers' caches and
sends a grouped shared-prefix workload all at once from a thread pool: `--num-groups` groups of
`--per-group` requests, each a group prefix of `--prefix-len` tokens plus a short distinct
question, generating `--output-len` tokens (`ignore_eos`). Reports requests/s, output tokens/s,
the CPU seconds the workers used (steadier than wall time when other jobs share the machine),
the workers' total prompt cache hit rate and how the router split the requests, as a Markdown
table with ratios against round_robin.

    python -m benchmarks.bench_router            # 8 groups x 16 requests, 600-token prefixes
    python -m benchmarks.bench_router --quick    # 4 x 8, 300-token prefixes: a smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from benchmarks.common import (
    PromptMaker,
    cpu_seconds,
    flush_cache,
    free_port,
    make_parser,
    markdown_table,
    start_module,
    stop_process,
)

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass
class RunResult:
    """One policy's measured run."""

    policy: str
    seconds: float
    requests: int
    output_tokens: int
    hit_rate: float
    split: list[int]  # requests routed to each worker
    worker_cpu: float  # CPU seconds the workers' processes used during the run

    @property
    def requests_per_s(self) -> float:
        """Finished requests per second of wall time."""
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.output_tokens / self.seconds


def workload(args: argparse.Namespace) -> list[str]:
    """The prompts, groups interleaved in a shuffled order."""
    maker = PromptMaker(None, args.seed)
    prompts = []
    for g in range(args.num_groups):
        prefix = f"Document {g}.\n" + maker.text(args.prefix_len) + "\n"
        for q in range(args.per_group):
            prompts.append(prefix + f"Question {q}: " + maker.text(args.question_len) + "\nAnswer:")
    random.Random(args.seed).shuffle(prompts)
    return prompts


def counters(worker_urls: list[str]) -> tuple[int, int]:
    """(cached, queried) prompt tokens summed over the workers."""
    cached = queried = 0
    for url in worker_urls:
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        cached += info["cached_prompt_tokens"]
        queried += info["queried_prompt_tokens"]
    return cached, queried


def family_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes and their children (the schedulers) so far.

    Less sensitive than wall time to other load on the machine: a worker waiting for a core
    accrues no CPU time.
    """
    family = list(pids)
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                family += [int(c) for c in f.read().split()]
    return sum(cpu_seconds(member) or 0.0 for member in family)


def run_policy(
    policy: str,
    worker_urls: list[str],
    worker_pids: list[int],
    prompts: list[str],
    args: argparse.Namespace,
) -> RunResult:
    """Start a router with `policy`, send the workload through it, stop the router."""
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--policy", policy, "--log-level", "warning"]
    flags += args.router_args.split()
    router = start_module(["sglite.router", *flags, "--worker-urls", *worker_urls], router_url)
    try:
        flush_cache(router_url, check=True)
        before = counters(worker_urls)
        cpu_before = family_cpu_seconds(worker_pids)
        sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}

        def send(prompt: str) -> int:
            # A connection per request: a shared client's pool would cap how many are in flight.
            body = {"text": prompt, "sampling_params": sampling}
            r = httpx.post(router_url + "/generate", json=body, timeout=3600)
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency or len(prompts)) as pool:
            tokens = list(pool.map(send, prompts))
        seconds = time.perf_counter() - t0
        cpu = family_cpu_seconds(worker_pids) - cpu_before
        after = counters(worker_urls)
        listed = httpx.get(router_url + "/list_workers", timeout=60).json()["workers"]
    finally:
        stop_process(router)
    hit_rate = (after[0] - before[0]) / max(1, after[1] - before[1])
    split = [w["routed"] for w in listed]
    return RunResult(policy, seconds, len(prompts), sum(tokens), hit_rate, split, cpu)


def warm_up(worker_urls: list[str], prompts: list[str], args: argparse.Namespace) -> None:
    """Send a batch of the workload to each worker directly, then flush: a process's first
    batches of a new shape run slower, which would penalise whichever policy runs first."""
    sampling = {"max_new_tokens": args.output_len, "ignore_eos": True}
    for url in worker_urls:

        def send(prompt: str, url: str = url) -> None:
            body = {"text": prompt, "sampling_params": sampling}
            httpx.post(url + "/generate", json=body, timeout=3600).raise_for_status()

        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(send, prompts))
        flush_cache(url, check=True)


def median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median wall time."""
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def print_table(results: dict[str, RunResult]) -> None:
    """Markdown table with ratios against round_robin."""
    base = results["round_robin"]
    heads = ["policy", "wall s", "req/s", "output tok/s", "vs round_robin", "worker CPU s",
             "CPU vs round_robin", "cache hit rate", "split"]  # fmt: skip
    rows = []
    for policy in POLICIES:
        r = results[policy]
        ratio = r.tokens_per_s / base.tokens_per_s
        cpu_ratio = base.worker_cpu / r.worker_cpu  # > 1: less work for the same requests
        split = "/".join(str(n) for n in r.split)
        rows.append(
            [policy, f"{r.seconds:.1f}", f"{r.requests_per_s:.2f}", f"{r.tokens_per_s:.1f}",
             f"{ratio:.2f}x", f"{r.worker_cpu:.1f}", f"{cpu_ratio:.2f}x", f"{r.hit_rate:.1%}",
             split]
        )  # fmt: skip
    print(markdown_table(heads, rows, pad=False))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=600, help="group prefix tokens")
    p.add_argument("--question-len", type=int, default=16, help="distinct question tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=0,
                   help="requests in flight at once (0: all at once); with a bound, requests "
                   "arrive over time, as from many clients")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="runs per policy (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-args", default="--num-threads 1 --log-level warning",
                   help="extra flags for each worker")  # fmt: skip
    p.add_argument("--router-args", default="", help="extra flags for each router")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="each worker's KV pool (default: the worker's own sizing)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="4 groups x 8, 300-token prefixes")
    args = p.parse_args(argv)
    if args.quick:
        args.num_groups, args.per_group, args.prefix_len, args.output_len = 4, 8, 300, 16
    return args


def main(argv: list[str] | None = None) -> None:
    """Start the workers, run every policy, print the table."""
    args = parse_args(argv)
    prompts = workload(args)
    print(f"load average before: {os.getloadavg()}", flush=True)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    workers = []
    try:
        for port, url in zip(ports, urls):
            flags = ["--port", str(port), *args.worker_args.split()]
            if args.max_total_tokens:
                flags += ["--max-total-tokens", str(args.max_total_tokens)]
            workers.append(start_module(["sglite.launch_server", *flags], url))
        warm_up(urls, prompts[: args.per_group], args)
        runs: dict[str, list[RunResult]] = {p: [] for p in POLICIES}
        for _ in range(args.repeats):
            for policy in POLICIES:  # interleaved, so drifting machine load hits all alike
                pids = [w.pid for w in workers]
                result = run_policy(policy, urls, pids, prompts, args)
                runs[policy].append(result)
                done = (
                    f"{policy}: {result.seconds:.1f} s, worker CPU {result.worker_cpu:.1f} s, "
                    f"hit rate {result.hit_rate:.1%}"
                )
                print(done, flush=True)
    finally:
        for proc in workers:
            stop_process(proc)
    print(f"load average after: {os.getloadavg()}")
    print(
        f"\n{args.num_groups} groups x {args.per_group} requests, {args.prefix_len}-token prefix "
        f"+ {args.question_len}-token question, {args.output_len} output tokens, "
        f"{len(prompts)} requests, {args.concurrency or 'all'} in flight at once; "
        f"worker KV pools: {args.max_total_tokens or 'default'} "
        f"tokens; router flags: {args.router_args or 'defaults'}; median of {args.repeats}\n"
    )
    print_table({p: median_run(r) for p, r in runs.items()})
    if len(runs["cache_aware"]) > 1:
        spread = [r.tokens_per_s for r in runs["cache_aware"]]
        print(f"\ncache_aware output tok/s over repeats: {statistics.mean(spread):.1f} mean")


if __name__ == "__main__":
    main()
