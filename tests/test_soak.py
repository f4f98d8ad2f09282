"""Soak: 40 concurrent clients against a real server, a fifth of them hanging up mid-request.

Mixed routes (native, OpenAI completions and chat), streaming and not, constrained and not,
short and long outputs, prompts that share prefixes. After every round the server is idle with
exact KV accounting; across rounds its file descriptors, asyncio tasks and memory stay flat; and
every request that completed gave the same output as that request run alone (greedy).

Bounded for CI (two rounds, about a minute on 2 cores); `SGLITE_SOAK_SECONDS=1800` runs rounds
for half an hour instead and prints the figures recorded in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from server_fixtures import ServerProcess

CLIENTS = 40
DISCONNECT_RATE = 0.2
SOAK_SECONDS = float(os.environ.get("SGLITE_SOAK_SECONDS", "0"))
MIN_ROUNDS = 2
SHARED = "You are a concise assistant. Answer in one short sentence.\n\n"
TOPICS = ["rivers", "volcanoes", "owls", "comets", "bridges", "deserts", "glaciers", "tigers"]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass(frozen=True)
class Spec:
    """One kind of request a client may send."""

    route: str
    stream: bool
    prompt: str
    max_tokens: int
    constraint: str | None  # None, "regex" or "json_schema"

    def body(self) -> dict[str, Any]:
        """The request body (greedy)."""
        if self.route == "/generate":
            params: dict[str, Any] = {"max_new_tokens": self.max_tokens, "temperature": 0}
            if self.constraint == "regex":
                params["regex"] = r"(yes|no|maybe)\."
            elif self.constraint == "json_schema":
                params["json_schema"] = json.dumps(PERSON)
            return {"text": self.prompt, "sampling_params": params, "stream": self.stream}
        body = {"max_tokens": self.max_tokens, "temperature": 0, "stream": self.stream}
        if self.route == "/v1/completions":
            body["prompt"] = self.prompt
            if self.constraint == "regex":
                body["regex"] = r"(yes|no|maybe)\."
        else:
            body["messages"] = [{"role": "user", "content": self.prompt}]
            if self.constraint == "json_schema":
                schema = {"name": "person", "schema": PERSON}
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return body


def make_specs() -> list[Spec]:
    """48 request kinds, deterministic."""
    rng = random.Random(7)
    specs = []
    for i in range(48):
        route = ["/generate", "/v1/completions", "/v1/chat/completions"][i % 3]
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"{SHARED}Question {i}: what is one fact about {topic}?"
        constraint = None
        if i % 4 == 0:
            constraint = "regex" if route != "/v1/chat/completions" else "json_schema"
            prompt = f"{SHARED}Is {topic} a good topic for question {i}? Answer:"
        specs.append(Spec(route, i % 2 == 1, prompt, rng.choice([4, 12, 32]), constraint))
    return specs


def _text_of(route: str, body: dict) -> str:
    if route == "/generate":
        return body["text"]
    choice = body["choices"][0]
    return choice["text"] if route == "/v1/completions" else choice["message"]["content"]


async def run_request(client: httpx.AsyncClient, spec: Spec, hang_up_after: int | None) -> Any:
    """Send one request. Returns its final text, or None when it hung up on purpose.

    `hang_up_after`: for a stream, close after this many events; otherwise, after this many
    tens of milliseconds.
    """
    if not spec.stream:

        async def whole() -> str:
            r = await client.post(spec.route, json=spec.body())
            assert r.status_code == 200, r.text
            return _text_of(spec.route, r.json())

        if hang_up_after is None:
            return await whole()
        try:
            return await asyncio.wait_for(whole(), hang_up_after / 100)
        except asyncio.TimeoutError:
            return None  # wait_for cancelled the request: the connection is closed
    text = ""
    events = 0
    async with client.stream("POST", spec.route, json=spec.body()) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return None
            if spec.route == "/generate":
                text = chunk["text"]
            elif spec.route == "/v1/completions":
                text += chunk["choices"][0]["text"] if chunk["choices"] else ""
            elif chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text


@dataclass
class Figures:
    """What the soak did, for the report."""

    served: int = 0
    hung_up: int = 0
    rounds: int = 0
    outputs: dict[Spec, set[str]] = field(default_factory=dict)


async def soak_round(url: str, specs: list[Spec], rng: random.Random, figures: Figures) -> None:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        plan = []
        for _ in range(CLIENTS):
            spec = rng.choice(specs)
            hang = None
            if rng.random() < DISCONNECT_RATE:
                hang = rng.randint(1, 6 if spec.stream else 60)
            plan.append((spec, hang))
        results = await asyncio.gather(*(run_request(client, s, h) for s, h in plan))
    for (spec, _), text in zip(plan, results):
        if text is None:
            figures.hung_up += 1
        else:
            figures.served += 1
            figures.outputs.setdefault(spec, set()).add(text)
    figures.rounds += 1


def _proc_stats(pid: int) -> tuple[int, int]:
    """(open file descriptors, resident memory in bytes) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/statm") as f:
        rss_pages = int(f.read().split()[1])
    return fds, rss_pages * os.sysconf("SC_PAGE_SIZE")


def _idle_info(url: str) -> dict:
    deadline = time.monotonic() + 60
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        busy = info["num_in_flight_reqs"] or info["num_running_reqs"] or info["num_queued_reqs"]
        if not busy:
            return info
        assert time.monotonic() < deadline, f"the server did not go idle: {info}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def soak_server():
    server = ServerProcess("--max-total-tokens", "8192")
    yield server
    assert server.stop() == 0, server.output()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600 + 2 * SOAK_SECONDS)  # a long soak must not hit the suite's timeout
def test_soak_many_clients_with_disconnects(soak_server):
    url = soak_server.url
    specs = make_specs()
    rng = random.Random(2026)
    figures = Figures()
    (scheduler_pid,) = soak_server.scheduler_pids()
    samples = []
    t0 = time.monotonic()
    while figures.rounds < MIN_ROUNDS or time.monotonic() - t0 < SOAK_SECONDS:
        asyncio.run(soak_round(url, specs, rng, figures))
        info = _idle_info(url)
        inv = info["kv_invariants"]
        assert inv["ok"] and inv["held_by_requests"] == 0, inv
        assert inv["free"] + inv["cached"] == info["max_total_num_tokens"], inv
        server_fds, server_rss = _proc_stats(soak_server.proc.pid)
        sched_fds, sched_rss = _proc_stats(scheduler_pid)
        samples.append((server_fds, sched_fds, info["num_server_tasks"], server_rss, sched_rss))
    # Flat: what the first (warm-up) round left open is all there is at the end.
    first, last = samples[0], samples[-1]
    assert last[0] <= first[0] + 2, f"server file descriptors grew: {samples}"
    assert last[1] <= first[1] + 2, f"scheduler file descriptors grew: {samples}"
    assert last[2] <= first[2] + 2, f"server asyncio tasks grew: {samples}"
    assert last[3] < first[3] * 1.15 + 50e6, f"server memory grew: {samples}"
    assert last[4] < first[4] * 1.15 + 50e6, f"scheduler memory grew: {samples}"
    assert figures.hung_up > 0 and figures.served > 0

    # Every completed request equals the same request run alone.
    async def alone() -> dict[Spec, str]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return {spec: await run_request(client, spec, None) for spec in figures.outputs}

    reference = asyncio.run(alone())
    for spec, texts in figures.outputs.items():
        assert texts == {reference[spec]}, (spec, texts, reference[spec])
    print(
        f"\nsoak: {figures.rounds} rounds, {figures.served} served, {figures.hung_up} hung up, "
        f"{time.monotonic() - t0:.0f} s; fds/tasks/rss per round: {samples}"
    )
