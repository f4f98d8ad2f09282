"""bench_pd's client: a round's schedule sent open loop as streamed /generate requests, and what
each request measured (TTFT, token events and the gaps between them, its error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.pd_workload import Arrival


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
