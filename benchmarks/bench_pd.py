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
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common import (
    PeerCrashed,
    PeerStatus,
    PromptMaker,
    command_line,
    flush_cache,
    free_port,
    make_parser,
    markdown_table,
    percentile,
    process_status,
    stop_process,
    wait_healthy,
)
from benchmarks.host import cpu_line

SETUPS = ("co-located", "PD")
LONG_OUTPUT_TOKENS = 4


# ---------------------------------------------------------------------------- workload
@dataclass
class Arrival:
    """One request of the schedule: when it is sent (s after the round starts) and what."""

    kind: str  # "short" or "long"
    at: float
    text: str
    max_new_tokens: int


def chat(maker: PromptMaker, message: str) -> str:
    """`message` as a user turn in the model's chat template, ready for the assistant."""
    return maker.tokenizer.apply_chat_template([{"role": "user", "content": message}])


def poisson_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    """Arrival times of a Poisson process of `rate`/s within [0, duration)."""
    times: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def schedule(maker: PromptMaker, args: argparse.Namespace, round_no: int) -> list[Arrival]:
    """Round `round_no`'s requests, seeded, so both setups get the same ones."""
    rng = random.Random(args.seed * 1000 + round_no)
    out = []
    for i, t in enumerate(poisson_times(rng, args.short_rate, args.duration)):
        message = f"Question {i}: " + maker.text(rng.randint(20, 40))
        out.append(Arrival("short", t, chat(maker, message), args.short_tokens))
    for i, t in enumerate(poisson_times(rng, args.long_rate, args.duration)):
        message = f"Report {round_no}-{i}. Summarize it.\n" + maker.text(args.long_prompt_tokens)
        out.append(Arrival("long", t, chat(maker, message), LONG_OUTPUT_TOKENS))
    return sorted(out, key=lambda a: a.at)


# ---------------------------------------------------------------------------- client
@dataclass
class Timing:
    """What one streamed request measured (seconds)."""

    kind: str
    ok: bool = False
    ttft: float = 0.0
    first: float = 0.0  # clock of the first token event
    last: float = 0.0  # clock of the latest token event
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between successive token events
    error: str = ""

    @property
    def mean_itl(self) -> float | None:
        """(last - first token event) / (tokens - 1); None with fewer than 2 tokens."""
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


def on_event(timing: Timing, event: dict, start: float) -> None:
    """Update `timing` from one SSE event of /generate."""
    if "error" in event:
        raise RuntimeError(str(event["error"].get("message", event["error"]))[:200])
    n = event["meta_info"]["completion_tokens"]
    if n <= timing.tokens:
        return
    now = time.perf_counter()
    if timing.tokens == 0:
        timing.ttft, timing.first = now - start, now
    else:
        timing.gaps.append(now - timing.last)
    timing.last, timing.tokens = now, n


async def stream_one(client: httpx.AsyncClient, arrival: Arrival, start: float) -> Timing:
    """Send one streamed greedy request; any failure is recorded, not raised."""
    timing = Timing(arrival.kind)
    params = {"max_new_tokens": arrival.max_new_tokens, "temperature": 0, "ignore_eos": True}
    body = {"text": arrival.text, "sampling_params": params, "stream": True}
    try:
        async with client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {text[:200]}"
                return timing
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    break
                if data:
                    on_event(timing, json.loads(data), start)
    except Exception as exc:  # counted as an error; the round goes on
        timing.error = f"{type(exc).__name__}: {exc}"[:300]
        return timing
    timing.ok = timing.tokens == arrival.max_new_tokens
    if not timing.ok:
        timing.error = f"{timing.tokens} of {arrival.max_new_tokens} tokens"
    return timing


@dataclass
class RoundResult:
    """One round of one setup."""

    setup: str
    wall: float  # the round's start to its last completion
    timings: list[Timing]


async def run_round(url: str, arrivals: list[Arrival], args: argparse.Namespace) -> RoundResult:
    """Open loop: each request leaves at its time, whatever is still running (up to the cap)."""
    cap = asyncio.Semaphore(args.max_concurrency)
    limits = httpx.Limits(
        max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency
    )
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(arrival: Arrival) -> Timing:
            await asyncio.sleep(max(0.0, t0 + arrival.at - time.perf_counter()))
            async with cap:
                return await stream_one(client, arrival, t0 + arrival.at)

        timings = await asyncio.gather(*(fire(a) for a in arrivals))
        return RoundResult("", time.perf_counter() - t0, list(timings))


# ---------------------------------------------------------------------------- servers
@dataclass
class Proc:
    """A started process, its URL and its log file."""

    name: str
    proc: subprocess.Popen
    url: str
    log: str


def spawn(name: str, cmd: list[str], port: int, log_dir: str) -> Proc:
    """Start `cmd` with its output in `log_dir/name.log`."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log)


def wait_all(procs: list[Proc], timeout: float = 600) -> None:
    """Until every process answers /health with 200; raises if one exits or time runs out."""
    for p in procs:
        wait_healthy(p.proc, p.url, timeout, name=p.name, log=p.log)


def server_cmd(args: argparse.Namespace, port: int, threads: int, *extra: str) -> list[str]:
    """`python -m sglite.launch_server` with the benchmark's common flags."""
    flags = ["--port", str(port), "--num-threads", str(threads), "--dtype", args.dtype]
    flags += ["--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning"]
    return [sys.executable, "-m", "sglite.launch_server", *flags, *extra, *args.server_args]


def pinned(cpu: int, cmd: list[str], pin: bool) -> list[str]:
    """`cmd` under `taskset -c cpu` when pinning."""
    return ["taskset", "-c", str(cpu), *cmd] if pin else cmd


def start_all(args: argparse.Namespace, pin: bool, log_dir: str, procs: list[Proc]) -> None:
    """Start both setups' servers (appended to `procs` as they start), then the PD router."""
    ports = {name: free_port() for name in ("colo", "prefill", "decode", "bootstrap", "router")}
    prefill_extra = ["--disaggregation-mode", "prefill"]
    prefill_extra += ["--disaggregation-bootstrap-port", str(ports["bootstrap"])]
    decode_extra = ["--disaggregation-mode", "decode"]
    cmds = {
        "colo": server_cmd(args, ports["colo"], 2),
        "prefill": pinned(0, server_cmd(args, ports["prefill"], 1, *prefill_extra), pin),
        "decode": pinned(1, server_cmd(args, ports["decode"], 1, *decode_extra), pin),
    }
    for name, cmd in cmds.items():
        procs.append(spawn(name, cmd, ports[name], log_dir))
    wait_all(procs)
    router = [sys.executable, "-m", "sglite.router", "--pd-disaggregation", "--port"]
    router += [str(ports["router"]), "--prefill", procs[1].url, "--decode", procs[2].url]
    procs.append(spawn("router", router + ["--log-level", "warning"], ports["router"], log_dir))
    wait_all(procs[3:], timeout=120)


def flush(url: str) -> None:
    """Empty a server's cache; it refuses while requests still run, so it is asked for a while."""
    flush_cache(url, retry_s=60, check=True)


def warm_up(url: str, maker: PromptMaker, args: argparse.Namespace) -> None:
    """One short and one long request, then a flush: first passes of a shape run slower."""
    arrivals = [
        Arrival("short", 0.0, chat(maker, "Warm-up: " + maker.text(30)), args.short_tokens),
        Arrival("long", 0.0, chat(maker, maker.text(args.long_prompt_tokens)), LONG_OUTPUT_TOKENS),
    ]
    result = asyncio.run(run_round(url, arrivals, args))
    for t in result.timings:
        if not t.ok:
            raise RuntimeError(f"warm-up request to {url} failed: {t.error}")
    flush(url)


def pd_counters(servers: dict[str, str]) -> dict[str, int]:
    """{"prefill transfers": n, "prefill failed": n, "decode ...": ...} from `{name: url}`; warns
    when a server's KV accounting is off."""
    counts = {}
    for name, url in servers.items():
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        counts[f"{name} transfers"] = int(info.get("disaggregation_transfers", 0))
        counts[f"{name} failed"] = int(info.get("disaggregation_failed_transfers", 0))
        if not info.get("kv_invariants", {}).get("ok", True):
            print(f"  !! {name}: KV invariants broken: {info['kv_invariants']}", flush=True)
    return counts


def statuses(procs: list[Proc]) -> list[PeerStatus]:
    """Each process's state now: ok while it runs, else crashed (its exit code and log)."""
    return [process_status(p.name, p.proc, p.log) for p in procs]


SETUP_PROCS = {"co-located": ("colo",), "PD": ("prefill", "decode", "router")}


def log_problems(procs: list[Proc]) -> list[str]:
    """Lines of the processes' logs that look like warnings, errors or tracebacks."""
    found = []
    for p in procs:
        with open(p.log, encoding="utf-8", errors="replace") as f:
            for line in f:
                if any(w in line.lower() for w in ("error", "warn", "traceback", "exception")):
                    found.append(f"{p.name}: {line.strip()[:300]}")
    return found


# ---------------------------------------------------------------------------- report
@dataclass
class Summary:
    """One setup's numbers over all its rounds (latencies in ms)."""

    setup: str
    ttft: tuple[float, float, float]
    itl: tuple[float, float, float]
    gap: tuple[float, float, float]
    max_gap: float
    long_ttft_p50: float
    short_per_s: float
    tokens_per_s: float
    requests: int
    errors: int


def pcts(values: list[float]) -> tuple[float, float, float]:
    """p50, p90, p99 in ms."""
    return tuple(1000 * percentile(values, q) for q in (50, 90, 99))  # type: ignore[return-value]


def summarize(setup: str, rounds: list[RoundResult]) -> Summary:
    """Aggregate a setup's rounds."""
    timings = [t for r in rounds for t in r.timings]
    short = [t for t in timings if t.kind == "short" and t.ok]
    long = [t for t in timings if t.kind == "long" and t.ok]
    gaps = [g for t in short for g in t.gaps]
    wall = sum(r.wall for r in rounds)
    return Summary(
        setup=setup,
        ttft=pcts([t.ttft for t in short]),
        itl=pcts([t.mean_itl for t in short if t.mean_itl is not None]),
        gap=pcts(gaps),
        max_gap=1000 * max(gaps, default=float("nan")),
        long_ttft_p50=1000 * percentile([t.ttft for t in long], 50),
        short_per_s=len(short) / wall,
        tokens_per_s=sum(t.tokens for t in timings) / wall,
        requests=len(timings),
        errors=sum(not t.ok for t in timings),
    )


def triple(values: tuple[float, float, float], digits: int = 0) -> str:
    """p50/p90/p99 as "a/b/c"."""
    return "/".join(f"{v:.{digits}f}" for v in values)


def print_table(summaries: dict[str, Summary], crashed: dict[str, str] | None = None) -> None:
    """Markdown table, one row per setup and a PD / co-located ratio row; a setup in `crashed`
    (one of its processes exited) has that in its errors cell."""
    crashed = crashed or {}
    heads = [
        "setup", "short TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "event gap p50/p90/p99 ms",
        "max gap ms", "long TTFT p50 ms", "short req/s done", "decode tok/s", "errors",
    ]  # fmt: skip
    rows = [
        [s.setup, triple(s.ttft), triple(s.itl, 1), triple(s.gap, 1), f"{s.max_gap:.0f}",
         f"{s.long_ttft_p50:.0f}", f"{s.short_per_s:.2f}", f"{s.tokens_per_s:.1f}",
         f"{s.errors} of {s.requests}" + (f"; {crashed[s.setup]}" if s.setup in crashed else "")]
        for s in summaries.values()
    ]  # fmt: skip
    pd, co = summaries["PD"], summaries["co-located"]
    rows.append(
        ["PD / co-located", f"p99 {ratio(pd.ttft[2], co.ttft[2])}",
         f"p99 {ratio(pd.itl[2], co.itl[2])}", f"p99 {ratio(pd.gap[2], co.gap[2])}",
         ratio(pd.max_gap, co.max_gap), ratio(pd.long_ttft_p50, co.long_ttft_p50),
         ratio(pd.short_per_s, co.short_per_s), ratio(pd.tokens_per_s, co.tokens_per_s), ""]
    )  # fmt: skip
    print(markdown_table(heads, rows, pad=False))


def ratio(a: float, b: float) -> str:
    """a / b as "1.23x", below 0.1 to 2 significant digits ("0.0033x"); "n/a" when b is 0 or
    either is nan."""
    if not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.2g}x"


def path_line(info: dict, pin: bool, transport: str) -> str:
    """Which paths the servers took: dtype, kernels, pinning, PD transport."""
    isa = ", ".join(info.get("kernel_isa") or []) or "portable C"
    kernels = f"native kernels ({isa})" if info.get("native_kernels") else "PyTorch (no native)"
    pins = "taskset -c 0 / -c 1" if pin else "UNPINNED (no taskset found)"
    return f"{info.get('dtype')}, {kernels}; PD servers {pins}; KV transfer {transport}"


def transport(args: argparse.Namespace) -> str:
    """The KV transport the decode server picks for a loopback prefill server."""
    from sglite.runtime.disaggregation.transport import choose_transport

    flag, configured = "--disaggregation-transfer-backend", "auto"
    for i, arg in enumerate(args.server_args):
        if arg == flag and i + 1 < len(args.server_args):
            configured = args.server_args[i + 1]
        elif arg.startswith(flag + "="):
            configured = arg.split("=", 1)[1]
    return f"{choose_transport(configured, '127.0.0.1')} ({configured})"


def describe_errors(setup: str, rounds: list[RoundResult]) -> None:
    """Print a setup's error count and a few of the messages."""
    errors = [t.error for r in rounds for t in r.timings if not t.ok]
    if errors:
        print(f"{setup}: {len(errors)} errors, e.g. {errors[:3]}", flush=True)


# ---------------------------------------------------------------------------- driver
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
