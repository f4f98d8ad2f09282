"""bench_pd's report: each setup's rounds summarized (latency percentiles, rates, errors), the
Markdown table with its PD / co-located ratio row, and the servers' path line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.common import markdown_table, percentile
from benchmarks.pd_client import RoundResult


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
