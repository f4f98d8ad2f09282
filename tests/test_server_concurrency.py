"""Many clients at once: streams stay correct, and clients that leave free their KV slots."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import requests

TOPICS = ["rivers", "mountains", "planets", "birds", "trees", "rockets", "castles", "islands"]
PROMPTS = [f"Tell me one short fact about {TOPICS[i % 8]} (question {i}):" for i in range(32)]
PARAMS = {"max_new_tokens": 16, "temperature": 0}


def server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Server info once nothing runs or waits (requests abort asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url)
        idle = info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
        if idle and info["num_in_flight_reqs"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is still busy: {info}")
        time.sleep(0.2)


def assert_no_leak(info: dict) -> None:
    inv = info["kv_invariants"]
    assert inv["ok"] is True, inv
    assert inv["held_by_requests"] == 0, inv
    assert inv["free"] + inv["cached"] == info["max_total_num_tokens"], inv


async def stream_one(client: httpx.AsyncClient, prompt: str) -> dict:
    body = {"text": prompt, "sampling_params": PARAMS, "stream": True}
    last = None
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                last = chunk
    return last


def test_32_concurrent_streams_are_correct(sglite_server):
    url = sglite_server.url
    ref = requests.post(
        url + "/generate", json={"text": PROMPTS, "sampling_params": PARAMS}, timeout=300
    ).json()

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, p) for p in PROMPTS))

    finals = asyncio.run(run())
    for prompt, final, expected in zip(PROMPTS, finals, ref, strict=True):
        assert final["meta_info"]["finish_reason"] is not None, prompt
        assert final["text"] == expected["text"], prompt
        assert final["output_ids"] == expected["output_ids"], prompt
    assert_no_leak(wait_idle(url))


def test_disconnected_streams_free_their_slots(sglite_server):
    url = sglite_server.url
    before = server_info(url)["aborted_requests"]
    body = {"sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}

    async def leave_early(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", "/generate", json={"text": f"Story {i}:", **body}) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        return  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await asyncio.gather(*(leave_early(client, i) for i in range(8)))

    asyncio.run(run())
    info = wait_idle(url)
    assert info["aborted_requests"] - before == 8
    assert_no_leak(info)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_disconnected_non_streamed_request_is_aborted(sglite_server, route):
    url = sglite_server.url
    before = server_info(url)["aborted_requests"]
    if route == "/generate":
        body = {
            "text": "A long tale:",
            "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
        }
    else:
        body = {"prompt": "A long tale:", "max_tokens": 600, "ignore_eos": True}
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        deadline = time.monotonic() + 30
        while server_info(url)["num_running_reqs"] == 0:  # wait until it is decoding
            assert time.monotonic() < deadline
            time.sleep(0.05)
    info = wait_idle(url)
    assert info["aborted_requests"] - before == 1
    assert_no_leak(info)
