"""The router in front of two real workers (`sglite serve` processes) on loopback.

Two workers start once for the module; each router is its own `python -m sglite.router`
process. The worker-killing test runs last: it restarts the worker it kills.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from server_fixtures import ServerProcess, free_port

from sglite.router.launch import main as router_main

# One torch thread each: two workers share this machine's 2 cores, and oversubscribed torch
# threads spin against each other (16 tokens took 15 s instead of 1 s with 2 threads each).
WORKER_ARGS = ("--num-threads", "1")
BODY_LIMIT = 100_000
GREEDY = {"temperature": 0, "max_new_tokens": 16}
WORDS = (
    "river stone lamp orbit garden violet cable quartz harbor meadow signal copper lantern "
    "thunder pebble falcon willow ember canyon glacier saddle marble compass tunnel beacon "
    "cedar prism anchor velvet summit"
).split()


class RouterProcess:
    """`python -m sglite.router` on a free loopback port, stopped with SIGTERM."""

    def __init__(
        self,
        *worker_urls: str,
        policy: str = "cache_aware",
        wait: bool = True,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "sglite.router", "--port", str(self.port), "--policy", policy,
            "--health-check-interval", "0.5", "--health-failure-threshold", "2",
            "--log-level", "warning", *extra, "--worker-urls", *worker_urls,
        ]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile(prefix="sglite-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the router exited:\n{self.output()}"
            try:
                workers = self.workers()
                if not wait or all(w["healthy"] for w in workers):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the router did not come up:\n{self.output()}")

    def output(self) -> str:
        """Everything the router printed so far."""
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def workers(self) -> list[dict]:
        """`/list_workers`' entries."""
        return requests.get(self.url + "/list_workers", timeout=10).json()["workers"]

    def worker(self, url: str) -> dict:
        """One worker's `/list_workers` entry."""
        return next(w for w in self.workers() if w["url"] == url)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Send `sig` and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workers():
    """Two workers, started in parallel; a list, so the test that kills one can replace it."""
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: ServerProcess(*WORKER_ARGS), range(2)))
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def ca_router(workers):
    # A small body limit, so the 413 test's body fits in the socket buffers: a body much larger
    # than those is refused while the client still writes it (a reset, not a readable 413).
    limit = ("--max-request-body-bytes", str(BODY_LIMIT))
    router = RouterProcess(*(w.url for w in workers), policy="cache_aware", extra=limit)
    yield router
    assert router.stop() == 0, router.output()


@pytest.fixture(scope="module")
def rr_router(workers):
    router = RouterProcess(*(w.url for w in workers), policy="round_robin")
    yield router
    assert router.stop() == 0, router.output()


def generate(url: str, text, **sampling) -> dict | list:
    body = {"text": text, "sampling_params": {**GREEDY, **sampling}}
    response = requests.post(url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(url: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed /generate, in order."""
    with requests.post(
        url + "/generate", json={**body, "stream": True}, stream=True, timeout=300
    ) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def counters(worker: ServerProcess) -> tuple[int, int]:
    """(cached, queried) prompt tokens the worker has counted since it started."""
    info = requests.get(worker.url + "/get_server_info", timeout=30).json()
    return info["cached_prompt_tokens"], info["queried_prompt_tokens"]


def flush(url: str) -> None:
    response = requests.post(url + "/flush_cache", timeout=30)
    assert response.status_code == 200, response.text


def prefix(seed: int, words: int = 250) -> str:
    """A distinct long text (~300 tokens at 250 words)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def test_cli_router_help_and_bad_flags(capsys):
    help_text = subprocess.run(
        [sys.executable, "-m", "sglite.cli", "router", "--help"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    for flag in ("--worker-urls", "--policy", "--cache-threshold", "--health-check-interval"):
        assert flag in help_text
    # Bad flags in-process (the same parser `python -m sglite.router` runs; a process each
    # would spend its time importing).
    for bad, message in [
        (["--policy", "random"], "invalid choice"),
        (["--cache-threshold", "2"], "cache_threshold"),
        (["--worker-urls", "localhost:1"], "url"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            router_main(bad, prog="python -m sglite.router")
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------- same answers
def test_generate_through_router_equals_worker(workers, ca_router):
    prompt = "The three primary colors are"
    direct = generate(workers[0].url, prompt)
    routed = generate(ca_router.url, prompt)
    assert routed["text"] == direct["text"] and routed["output_ids"] == direct["output_ids"]
    batch = generate(ca_router.url, [prompt, "Once upon a time"])
    assert isinstance(batch, list) and batch[0]["text"] == direct["text"]
    by_ids = requests.post(
        ca_router.url + "/generate",
        json={"input_ids": direct["output_ids"][:4], "sampling_params": GREEDY},
        timeout=300,
    )
    assert by_ids.status_code == 200 and by_ids.json()["meta_info"]["prompt_tokens"] == 4

    events = stream_events(ca_router.url, {"text": prompt, "sampling_params": GREEDY})
    assert events[-1] == "[DONE]" and len(events) > 3  # relayed event by event
    assert json.loads(events[-2])["text"] == direct["text"]


def test_openai_client_through_router(workers, ca_router):
    direct = openai.OpenAI(base_url=workers[1].url + "/v1", api_key="unused")
    routed = openai.OpenAI(base_url=ca_router.url + "/v1", api_key="unused")
    model = routed.models.list().data[0].id
    assert model == direct.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a fruit."}]
    kwargs = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    want = direct.chat.completions.create(**kwargs).choices[0].message.content
    assert routed.chat.completions.create(**kwargs).choices[0].message.content == want

    args = {"model": model, "prompt": "Water boils at", "max_tokens": 12, "temperature": 0}
    want = direct.completions.create(**args).choices[0].text
    chunks = list(routed.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


# ---------------------------------------------------------------------------- cache affinity
def test_shared_prefix_lands_on_the_same_worker(workers, ca_router):
    flush(ca_router.url)
    shared = prefix(seed=100)
    before = [counters(w) for w in workers]
    first = generate(ca_router.url, shared + "Question: which word comes first?", max_new_tokens=2)
    second = generate(ca_router.url, shared + "Question: which word is last?", max_new_tokens=2)
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] >= prompt_tokens - 16
    queried = [counters(w)[1] - b[1] for w, b in zip(workers, before)]
    assert sorted(q > 0 for q in queried) == [False, True], f"both workers were used: {queried}"


def grouped_hit_rate(router: RouterProcess, workers: list[ServerProcess]) -> float:
    """Total cache hit rate over the workers for 4 groups x 4 requests sharing a long prefix."""
    flush(router.url)
    before = [counters(w) for w in workers]
    texts = [prefix(seed=g) + f"Question {i}: repeat word {i}." for g in range(4) for i in range(4)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: generate(router.url, t, max_new_tokens=2), texts))
    after = [counters(w) for w in workers]
    cached = sum(a[0] - b[0] for a, b in zip(after, before))
    queried = sum(a[1] - b[1] for a, b in zip(after, before))
    return cached / queried


def test_cache_aware_hit_rate_beats_round_robin(workers, ca_router, rr_router):
    cache_aware = grouped_hit_rate(ca_router, workers)
    round_robin = grouped_hit_rate(rr_router, workers)
    # cache_aware: 3 of each group's 4 requests hit (~0.7); round robin: ~2 of 4 (~0.45)
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)
    decisions = [w["decisions"] for w in ca_router.workers()]
    assert sum(d.get("prefix_match", 0) for d in decisions) >= 12


# ---------------------------------------------------------------------------- errors, membership
def test_bad_input_answers_400(ca_router):
    url = ca_router.url
    for body in (b"{not json", b"[1, 2]", b"", b"\xff\xfe{", b"[" * 100_000):
        r = requests.post(url + "/generate", data=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param"}
    r = requests.post(url + "/generate", json={"text": "x", "sampling_params": {"top_p": 7}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.top_p"
    r = requests.post(url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert requests.get(url + "/no_such_route", timeout=30).status_code == 404
    big = b'{"text": "' + b"x" * (2 * BODY_LIMIT) + b'"}'
    r = requests.post(url + "/generate", data=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    for query in ("", "?url=not-a-url", "?url=http://x:1/path"):
        r = requests.post(url + "/add_worker" + query, timeout=30)
        assert r.status_code == 400 and "url" in r.json()["error"]["message"], r.text
    # the router kept serving
    assert requests.get(url + "/health", timeout=30).status_code == 200


def test_remove_and_add_worker(workers, rr_router):
    url, (first, second) = rr_router.url, workers
    r = requests.post(url + "/remove_worker", params={"url": second.url}, timeout=30)
    assert r.status_code == 200, r.text
    assert [w["url"] for w in rr_router.workers()] == [first.url]
    before = rr_router.worker(first.url)["routed"]
    for i in range(3):
        generate(url, f"Count to {i}:", max_new_tokens=2)
    assert rr_router.worker(first.url)["routed"] == before + 3
    r = requests.post(url + "/remove_worker", params={"url": second.url}, timeout=30)
    assert r.status_code == 404

    r = requests.post(url + "/add_worker", params={"url": second.url + "/"}, timeout=30)
    assert r.status_code == 200 and r.json()["worker"]["healthy"] is True, r.text
    r = requests.post(url + "/add_worker", params={"url": second.url}, timeout=30)
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    for i in range(2):
        generate(url, f"Count to {i}:", max_new_tokens=2)
    assert rr_router.worker(second.url)["routed"] >= 1


def test_flush_cache_and_info_through_router(workers, ca_router):
    generate(ca_router.url, "Fill the cache with this text", max_new_tokens=1)
    r = requests.post(ca_router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and "flushed" in r.text
    assert all(w["tree_size"] == 0 for w in ca_router.workers())
    for worker in workers:
        info = requests.get(worker.url + "/get_server_info", timeout=30).json()
        assert info["cache_size_tokens"] == 0
    info = requests.get(ca_router.url + "/get_server_info", timeout=30).json()
    assert info["router"]["policy"] == "cache_aware" and "model_path" in info
    assert requests.get(ca_router.url + "/get_model_info", timeout=30).json()["is_generation"]


def test_metrics_per_worker(workers, ca_router):
    generate(ca_router.url, "Metrics please", max_new_tokens=1)
    text = requests.get(ca_router.url + "/metrics", timeout=30).text
    for worker in workers:
        label = f'worker="{worker.url}"'
        assert f"sglite_router:worker_healthy{{{label}}} 1.0" in text
        assert f"sglite_router:in_flight_requests{{{label}}} 0.0" in text
        assert f"sglite_router:requests_total{{{label}}}" in text
        assert f"sglite_router:retries_total{{{label}}}" in text
    assert 'kind="prefix_match"' in text or 'kind="low_match"' in text


def test_no_healthy_worker_answers_503():
    nobody = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess(nobody, wait=False)
    try:
        assert router.worker(nobody)["healthy"] is False
        calls = [
            ("/generate", {"text": "hi"}),
            ("/generate", {"text": "hi", "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]
        for path, body in calls:
            r = requests.post(router.url + path, json=body, timeout=30)
            assert r.status_code == 503, r.text
            assert set(r.json()["error"]) >= {"message", "type", "param"}
        assert requests.get(router.url + "/health", timeout=30).status_code == 503
        assert requests.get(router.url + "/v1/models", timeout=30).status_code == 503
    finally:
        assert router.stop(signal.SIGINT) == 0, router.output()  # Ctrl-C is a clean exit too


# ---------------------------------------------------------------------------- failures
class OverloadedWorker:
    """A real HTTP server that is healthy but answers every /generate with 503, as an sglite
    worker does past --max-queued-requests or while it shuts down."""

    def __init__(self) -> None:
        self.calls = 0
        app = FastAPI()

        @app.get("/health")
        def health() -> str:
            return "OK"

        @app.post("/generate")
        def generate() -> JSONResponse:
            self.calls += 1
            body = {"error": {"message": "overloaded", "type": "service_unavailable_error"}}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_worker_503_is_retried_elsewhere_but_4xx_is_not(workers):
    overloaded = OverloadedWorker()
    router = RouterProcess(overloaded.url, workers[0].url, policy="round_robin")
    try:
        for i in range(4):  # round robin sends half of them to the overloaded one first
            generate(router.url, f"Retry me {i}:", max_new_tokens=2)
        entry = router.worker(overloaded.url)
        assert overloaded.calls >= 2 and entry["retries"] == overloaded.calls
        assert entry["healthy"] is True  # busy is not dead
        bad = {"text": "x", "sampling_params": {"temperature": -1}}
        for _ in range(2):
            r = requests.post(router.url + "/generate", json=bad, timeout=30)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "sampling_params.temperature"
        assert router.worker(workers[0].url)["retries"] == 0  # its 400s were not retried
        requests.post(router.url + "/remove_worker", params={"url": workers[0].url}, timeout=30)
        r = requests.post(router.url + "/generate", json={"text": "hi"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"  # passed on as-is
        assert r.json()["error"]["message"] == "overloaded"
    finally:
        assert router.stop() == 0, router.output()
        overloaded.stop()


def test_killed_worker_loses_no_request_and_comes_back(workers, rr_router):
    """SIGKILL one worker under load: non-streamed requests are retried on the other, a stream
    it was serving ends with an error event; the worker restarted on its URL gets traffic."""
    url = rr_router.url
    victim = workers[1]
    long_run = {"max_new_tokens": 48, "ignore_eos": True}
    # Streams long enough to be still running at the kill whatever the machine's speed.
    body = {
        "text": "Tell a long story about a lighthouse.",
        "sampling_params": {**GREEDY, "max_new_tokens": 160, "ignore_eos": True},
    }

    def one(i: int) -> dict:
        return generate(url, f"Story {i}: once upon a time", **long_run)

    with ThreadPoolExecutor(14) as pool:
        # The two streams alone first: round robin then gives each worker one of them (sent
        # together with the other requests, both could land on the survivor).
        streams = [pool.submit(stream_events, url, body) for _ in range(2)]
        deadline = time.monotonic() + 120
        while not all(_running(w) for w in workers):
            assert time.monotonic() < deadline, "the streams never started on both workers"
            time.sleep(0.2)
        futures = [pool.submit(one, i) for i in range(12)]
        while _running_count(victim) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # some non-streamed requests in flight on the victim too
        os.kill(victim.proc.pid, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
        events = [s.result(timeout=300) for s in streams]
    victim.proc.wait(30)

    assert all(r["meta_info"]["completion_tokens"] == 48 for r in results)
    assert all(e[-1] == "[DONE]" for e in events)
    broken = [e for e in events if any('"error"' in x for x in e)]
    assert len(broken) >= 1, "no stream was on the killed worker"
    entry = rr_router.worker(victim.url)
    assert entry["healthy"] is False and entry["retries"] >= 1, entry

    restarted = ServerProcess(*WORKER_ARGS, port=victim.port)
    workers[1] = restarted  # the fixture stops whatever is in the list
    deadline = time.monotonic() + 30
    while not rr_router.worker(victim.url)["healthy"]:
        assert time.monotonic() < deadline, "health checks did not bring the worker back"
        time.sleep(0.2)
    routed = rr_router.worker(victim.url)["routed"]
    for i in range(4):
        generate(url, f"Back again {i}:", max_new_tokens=2)
    assert rr_router.worker(victim.url)["routed"] >= routed + 2
    assert counters(restarted)[1] > 0  # the new process really served them


def _running_count(worker: ServerProcess) -> int:
    info = requests.get(worker.url + "/get_server_info", timeout=30).json()
    return info["num_running_reqs"]


def _running(worker: ServerProcess) -> bool:
    return _running_count(worker) > 0
