"""The serving benchmark's report: each workload's row (throughput, TTFT, ITL and end-to-end
latency percentiles, cache hit rate), the Markdown table, the run's summary lines and the JSON
file."""

from __future__ import annotations

import argparse
import json

from benchmarks.common import PeerStatus, markdown_table, percentile
from benchmarks.serving_client import Result


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
