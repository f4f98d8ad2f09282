"""The serving benchmark's client: request bodies and stream parsing for the native and
OpenAI-compatible APIs, one streamed request timed chunk by chunk, and the open-loop load of
Poisson arrivals."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.serving_workloads import Request


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
