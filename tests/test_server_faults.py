"""Faults and limits on a real server: the scheduler process killed (restart or exit non-zero),
per-request timeouts, body / n / max_tokens limits, CORS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
import requests
from server_fixtures import ServerProcess

GREEDY = {"max_new_tokens": 8, "temperature": 0}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def limited_server():
    """Tight limits and --restart-on-failure; the last test kills its scheduler."""
    server = ServerProcess(
        "--request-timeout", "6", "--max-request-body-bytes", "200000", "--max-n", "4",
        "--max-new-tokens-limit", "2000", "--allow-origins", ORIGIN, "--restart-on-failure",
        "--default-max-tokens", "24",
    )  # fmt: skip
    yield server
    assert server.stop() == 0, server.output()[-3000:]


def _info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()


def _wait_idle_and_clean(url: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        info = _info(url)
        if info["num_in_flight_reqs"] == 0 and info["num_running_reqs"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    assert info["kv_invariants"]["ok"] and info["kv_invariants"]["held_by_requests"] == 0, info
    return info


# ---------------------------------------------------------------------------- limits
def test_body_over_the_limit_is_413(limited_server):
    url = limited_server.url
    big = {"text": "word " * 50000, "sampling_params": GREEDY}  # about 250 kB
    r = requests.post(url + "/generate", json=big, timeout=30)
    assert r.status_code == 413, r.text
    assert "--max-request-body-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit still holds while reading
        for _ in range(30):
            yield b" " * 10000

    try:
        r = requests.post(url + "/generate", data=chunked(), timeout=30)
        assert r.status_code == 413, r.text
    except requests.ConnectionError:
        pass  # refused while the client was still sending: also a refusal
    assert requests.post(url + "/generate", json={"text": "Hi", "sampling_params": GREEDY}).ok


@pytest.mark.parametrize(
    "route,body,needle",
    [
        ("/generate", {"text": "Hi", "sampling_params": {"n": 5}}, "--max-n"),
        ("/v1/completions", {"prompt": "Hi", "n": 5}, "--max-n"),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2001}},
         "max_new_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2001}, "max_tokens"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2001}, "max_tokens"),
    ],
)  # fmt: skip
def test_caps_on_n_and_max_tokens_are_400(limited_server, route, body, needle):
    r = requests.post(limited_server.url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_chat_without_max_tokens_is_capped_not_refused(limited_server):
    # Unset max_tokens means "the rest of the context" (8k here), over the 2000 cap: the request
    # is served (streamed here, so the test does not wait for the whole answer).
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stream": True}
    with requests.post(
        limited_server.url + "/v1/chat/completions", json=body, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200, r.text
        first = next(line for line in r.iter_lines() if line)
    assert b"chat.completion.chunk" in first, first


def test_a_request_without_a_budget_gets_the_default_one(limited_server):
    """A chat or Responses request that sets no max_tokens ends at --default-max-tokens (24
    here), not at the context's end: a request that never stops (ignore_eos) stays cheap."""
    url = limited_server.url
    ask = [{"role": "user", "content": "Tell me a long story."}]
    chat = {"messages": ask, "temperature": 0, "ignore_eos": True}
    r = requests.post(url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 24
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = requests.post(url + "/v1/responses", json={"input": ""}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 24
    explicit = {**chat, "max_tokens": 40}  # an explicit budget is the client's, past the default
    r = requests.post(url + "/v1/chat/completions", json=explicit, timeout=120)
    assert r.json()["usage"]["completion_tokens"] == 40


def test_request_timeout_ends_requests_with_504_and_frees_slots(limited_server):
    url = limited_server.url
    long = {"max_new_tokens": 1900, "ignore_eos": True}
    t0 = time.monotonic()
    r = requests.post(url + "/generate", json={"text": "A", "sampling_params": long}, timeout=60)
    assert r.status_code == 504, r.text
    assert "--request-timeout" in r.json()["error"]["message"]
    assert 5.5 < time.monotonic() - t0 < 30
    body = {"prompt": "A", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    assert b"--request-timeout" in lines[-2] and b"timeout_error" in lines[-2], lines[-2]
    _wait_idle_and_clean(url)


def test_cors_only_for_the_allowed_origin(limited_server, sglite_server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = requests.options(limited_server.url + "/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = dict(preflight, Origin="https://evil.example")
    r = requests.options(limited_server.url + "/v1/completions", headers=other, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    # Off by default.
    r = requests.options(sglite_server.url + "/v1/completions", headers=preflight, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    r = requests.get(sglite_server.url + "/health", headers={"Origin": ORIGIN}, timeout=30)
    assert "access-control-allow-origin" not in r.headers


def test_binds_loopback_by_default(sglite_server):
    assert _info(sglite_server.url)["host"] == "127.0.0.1"


# ---------------------------------------------------------------------------- scheduler death
def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=5).status_code == 200
    except requests.ConnectionError:  # the server is gone
        return False


def _stream_until_error(url: str, out: list[bytes], started: threading.Event) -> None:
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


def _kill_scheduler_mid_stream(server: ServerProcess) -> tuple[list[bytes], threading.Thread]:
    (scheduler,) = server.scheduler_pids()
    lines: list[bytes] = []
    started = threading.Event()
    t = threading.Thread(target=_stream_until_error, args=(server.url, lines, started))
    t.start()
    assert started.wait(60)
    os.kill(scheduler, signal.SIGKILL)
    t0 = time.monotonic()
    while _healthy(server.url):
        assert time.monotonic() - t0 < 2, "/health still says healthy after the scheduler died"
        time.sleep(0.05)
    t.join(30)
    assert not t.is_alive()
    return lines, t


def test_killed_scheduler_is_restarted(limited_server):
    """Runs last on limited_server: kills its scheduler."""
    url = limited_server.url
    prompt = {"text": "The three primary colors are", "sampling_params": GREEDY}
    before = requests.post(url + "/generate", json=prompt, timeout=60).json()
    (old_pid,) = limited_server.scheduler_pids()
    lines, _ = _kill_scheduler_mid_stream(limited_server)
    assert lines[-1] == b"data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert "scheduler process exited" in error["message"], error
    deadline = time.monotonic() + 240
    while not _healthy(url):
        assert time.monotonic() < deadline, limited_server.output()[-3000:]
        time.sleep(0.5)
    (new_pid,) = limited_server.scheduler_pids()
    assert new_pid != old_pid
    after = requests.post(url + "/generate", json=prompt, timeout=60)
    assert after.status_code == 200, after.text
    assert after.json()["text"] == before["text"]
    info = _wait_idle_and_clean(url)
    assert info["scheduler_restarts"] == 1


def test_killed_scheduler_without_restart_exits_nonzero():
    server = ServerProcess("--disable-web-ui")  # this server also checks the page is off
    try:
        assert requests.get(server.url + "/", timeout=10).status_code == 404
        assert requests.get(server.url + "/ui/app.js", timeout=10).status_code == 404
        lines, _ = _kill_scheduler_mid_stream(server)
        assert b"scheduler process exited" in lines[-2]
        code = server.proc.wait(60)
        assert code == 1, server.output()[-3000:]
        assert "scheduler process exited" in server.output()
    finally:
        server.stop()


# ---------------------------------------------------------------------------- pool exhaustion
def test_tiny_pool_queues_and_retracts_then_503_past_the_queue_bound(sglite_server):
    """16 clients at once on a 256-token pool that holds about 6 of their requests, with at
    most 12 in flight: the first 12 queue (and are retracted under pressure) and complete with
    the same output as on a roomy server; the rest get 503 with Retry-After."""
    server = ServerProcess(
        "--max-total-tokens", "256", "--max-queued-requests", "12", "--chunked-prefill-size", "64"
    )
    try:
        prompts = [f"Write a list of facts about the number {i}:" for i in range(16)]
        params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                return await asyncio.gather(
                    *(
                        client.post("/generate", json={"text": p, "sampling_params": params})
                        for p in prompts
                    )
                )

        responses = asyncio.run(run())
        ok = [(p, r) for p, r in zip(prompts, responses) if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert len(ok) >= 12, [r.status_code for r in responses]
        for r in refused:
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert "--max-queued-requests" in r.json()["error"]["message"]
        reference = requests.post(
            sglite_server.url + "/generate",
            json={"text": [p for p, _ in ok], "sampling_params": params},
            timeout=600,
        ).json()
        for (prompt, r), ref in zip(ok, reference):
            assert r.json()["output_ids"] == ref["output_ids"], prompt
        info = _wait_idle_and_clean(server.url)
        assert info["retractions"] > 0, "the pool was never under pressure"
    finally:
        server.stop()
