"""Disaggregated prefill and decode on real servers (docs/pd.md).

A prefill server and a decode server of the default model (float32) on loopback ports, paired
per request by the bootstrap fields, either sent by the test itself (to check each server's
side) or by the PD router (`python -m sglite.router --pd-disaggregation`). Outputs must equal
the prefill server's own answer to the same request without disaggregation, and every fault
must end the request cleanly with both servers' KV accounting intact.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import openai
import pytest
import requests
from server_fixtures import ServerProcess, free_port

pytestmark = pytest.mark.slow

# Two servers (and sometimes a third) share two cores: one torch thread each. The transfer
# timeout bounds the fault tests' waits; it is also a prefill's whole budget, which a 200-token
# prompt in 32-token chunks on one thread overran at 4 s while the other test worker loaded
# the cores (1.0-1.4 s alone).
COMMON = ("--num-threads", "1", "--disaggregation-transfer-timeout", "8")
GREEDY = {"temperature": 0, "max_new_tokens": 12}
_rooms = itertools.count(1000)


def start_prefill(*extra: str) -> tuple[ServerProcess, int]:
    """A prefill server (chunks of 32 tokens, so long prompts stream pages) and its port."""
    port = free_port()
    server = ServerProcess(
        *COMMON, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
        str(port), "--chunked-prefill-size", "32", *extra,
    )  # fmt: skip
    return server, port


@pytest.fixture(scope="module")
def servers():
    """(prefill server, its bootstrap port, decode server, a second decode server that one test
    kills), started side by side."""
    with cf.ThreadPoolExecutor(3) as pool:
        prefill_job = pool.submit(start_prefill)
        decode_jobs = [
            pool.submit(ServerProcess, *COMMON, "--disaggregation-mode", "decode") for _ in "ab"
        ]
        (prefill, port), (decode, spare) = prefill_job.result(), [j.result() for j in decode_jobs]
    yield prefill, port, decode, spare
    for server in (prefill, decode, spare):
        server.stop()


@pytest.fixture(scope="module")
def pd(servers):
    """(prefill server, its bootstrap port, decode server)."""
    return servers[:3]


def info(server: ServerProcess) -> dict[str, Any]:
    return requests.get(server.url + "/get_server_info", timeout=30).json()


def settled(server: ServerProcess, timeout: float = 20.0) -> dict[str, Any]:
    """The server's info once nothing runs, waits or is held between the servers."""
    keys = (
        "num_running_reqs", "num_queued_reqs", "disaggregation_held_requests",
        "disaggregation_waiting_pulls", "disaggregation_queued_requests",
        "disaggregation_receiving_requests",
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        current = info(server)
        if all(current.get(k, 0) == 0 for k in keys) or time.monotonic() > deadline:
            assert all(current.get(k, 0) == 0 for k in keys), {k: current.get(k) for k in keys}
            assert current["kv_invariants"]["ok"], current["kv_invariants"]
            return current
        time.sleep(0.2)


def bootstrap(port: int) -> dict[str, Any]:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": next(_rooms)}


def paired(prefill: ServerProcess, decode: ServerProcess, path: str, body: dict) -> Any:
    """Send `body` to both servers at once (as the PD router does); the decode's response."""
    with cf.ThreadPoolExecutor(2) as pool:
        on_prefill = pool.submit(
            requests.post, prefill.url + path, json=dict(body, stream=False), timeout=120
        )
        on_decode = pool.submit(requests.post, decode.url + path, json=body, timeout=120)
        assert on_prefill.result().status_code == 200, on_prefill.result().text
        return on_decode.result()


def flat(entries: Any) -> list[float]:
    """Every number in a logprob structure, None (no logprob) as nan-free 0.0, in order."""
    if isinstance(entries, list):
        return [x for e in entries for x in flat(e)]
    return [0.0 if entries is None else float(entries)]


def story(words: int, salt: int = 0) -> str:
    """A long prompt; a distinct `salt` gives text no earlier test cached (a real prefill)."""
    return " ".join(
        f"item{(i + salt) % 97} is near item{(i * 7 + salt) % 89};" for i in range(words)
    )


PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    story(120),  # several 32-token prefill chunks: pages stream while later chunks compute
]


def test_decode_output_equals_one_server_and_computes_no_prompt(pd):
    prefill, port, decode = pd
    before = info(decode)
    uncached = 0
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": GREEDY}
        alone = requests.post(prefill.url + "/generate", json=body, timeout=120).json()
        answer = paired(prefill, decode, "/generate", dict(body, **bootstrap(port)))
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result["output_ids"] == alone["output_ids"]
        assert result["text"] == alone["text"]
        meta = result["meta_info"]
        assert meta["prompt_tokens"] == alone["meta_info"]["prompt_tokens"]
        uncached += meta["prompt_tokens"] - meta["cached_tokens"]  # the decode's own cache
    after = settled(decode)
    assert after["prefill_tokens_computed"] == before["prefill_tokens_computed"]
    assert after["disaggregation_transfers"] - before["disaggregation_transfers"] == len(PROMPTS)
    key = "disaggregation_transferred_tokens"
    assert after[key] - before[key] == uncached  # every token the decode lacked, no more
    settled(prefill)


def test_seeded_sampling_logprobs_n_and_streaming_match(pd):
    prefill, port, decode = pd
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_new_tokens": 10, "n": 2}
    body = {
        "text": "Name three colors:", "sampling_params": params, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2,
    }  # fmt: skip
    alone = requests.post(prefill.url + "/generate", json=body, timeout=120).json()
    result = paired(prefill, decode, "/generate", dict(body, **bootstrap(port))).json()
    assert [r["output_ids"] for r in result] == [r["output_ids"] for r in alone]
    for got, want in zip(result, alone, strict=True):
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
            assert flat(got["meta_info"][key]) == pytest.approx(flat(want["meta_info"][key]))
    # Streaming: the decode server's stream carries the same text piece by piece.
    stream_body = {"text": PROMPTS[1], "sampling_params": GREEDY, "stream": True}
    alone_text = requests.post(
        prefill.url + "/generate", json=dict(stream_body, stream=False), timeout=120
    ).json()["text"]
    response = paired(prefill, decode, "/generate", dict(stream_body, **bootstrap(port)))
    chunks = [line for line in response.text.splitlines() if line.startswith("data: {")]
    assert len(chunks) > 2
    assert json.loads(chunks[-1][6:])["text"] == alone_text
    settled(decode)
    settled(prefill)


def test_openai_chat_through_both_servers(pd):
    prefill, port, decode = pd
    messages = [{"role": "user", "content": "Say hello to Ada."}]
    body = {"model": "x", "messages": messages, "max_tokens": 12, "temperature": 0}
    alone = requests.post(prefill.url + "/v1/chat/completions", json=body, timeout=120).json()
    answer = paired(prefill, decode, "/v1/chat/completions", dict(body, **bootstrap(port)))
    assert answer.json()["choices"][0]["message"] == alone["choices"][0]["message"]


def test_bootstrap_fields_are_checked(pd, sglite_server):
    prefill, port, decode = pd
    body = {"text": "Hi", "sampling_params": GREEDY}
    plain = requests.post(sglite_server.url + "/generate", json=dict(body, **bootstrap(port)))
    assert plain.status_code == 400 and "--disaggregation-mode" in plain.text
    partial = dict(body, bootstrap_host="127.0.0.1", bootstrap_room=5)
    missing = requests.post(decode.url + "/generate", json=partial)
    assert missing.status_code == 400 and "bootstrap_port" in missing.json()["error"]["param"]
    # A request without bootstrap fields is served whole by either server.
    whole = requests.post(decode.url + "/generate", json=body, timeout=60)
    assert whole.status_code == 200 and whole.json()["meta_info"]["completion_tokens"] > 0


def test_transfer_timeouts_free_both_sides(pd):
    prefill, port, decode = pd
    body = {"text": story(40), "sampling_params": GREEDY}
    # The decode server waits for a prefill that never comes: an error naming the timeout.
    lonely = requests.post(decode.url + "/generate", json=dict(body, **bootstrap(port)), timeout=60)
    assert lonely.status_code == 502 and "timed out" in lonely.json()["error"]["message"]
    # The prefill server holds pages nobody pulls: freed at its deadline.
    held = requests.post(prefill.url + "/generate", json=dict(body, **bootstrap(port)), timeout=60)
    assert held.status_code == 200
    assert info(prefill)["disaggregation_held_requests"] == 1
    after = settled(prefill, timeout=15)
    assert after["disaggregation_failed_transfers"] >= 1
    settled(decode)


def test_decode_server_dying_mid_transfer_frees_the_prefill_side(servers):
    prefill, port, _, victim = servers
    body = dict({"text": story(150, salt=1), "sampling_params": GREEDY}, **bootstrap(port))
    with cf.ThreadPoolExecutor(2) as pool:
        on_prefill = pool.submit(requests.post, prefill.url + "/generate", json=body, timeout=120)
        pool.submit(requests.post, victim.url + "/generate", json=body, timeout=120)
        deadline = time.monotonic() + 30
        while info(prefill).get("disaggregation_waiting_pulls", 0) == 0:
            assert time.monotonic() < deadline, "the decode server never asked for the pages"
            time.sleep(0.05)
        victim.proc.send_signal(signal.SIGKILL)  # its pull arrived; pages are streaming
        victim.proc.wait()
        assert on_prefill.result().status_code == 200
    settled(prefill, timeout=15)
    alive = requests.post(prefill.url + "/generate", json={"text": "Hi", "sampling_params": GREEDY})
    assert alive.status_code == 200


# ---------------------------------------------------------------------------- through the router
class PDRouter:
    """`python -m sglite.router --pd-disaggregation` over one prefill and one decode server."""

    def __init__(self, prefill: ServerProcess, decode: ServerProcess) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "sglite.router", "--port", str(self.port),
            "--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
            "--health-check-interval", "0.5", "--health-failure-threshold", "1",
            "--log-level", "warning",
        ]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile(prefix="sglite-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def output(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def router(pd):
    prefill, _, decode = pd
    started = PDRouter(prefill, decode)
    yield started
    started.stop()


def test_router_answers_equal_one_server_on_both_apis(pd, router):
    prefill, _, decode = pd
    before = info(decode)
    for prompt in PROMPTS[1:]:
        body = {"text": prompt, "sampling_params": GREEDY}
        alone = requests.post(prefill.url + "/generate", json=body, timeout=120).json()
        routed = requests.post(router.url + "/generate", json=body, timeout=120)
        assert routed.status_code == 200, routed.text
        assert routed.json()["output_ids"] == alone["output_ids"]
        streamed = requests.post(
            router.url + "/generate", json=dict(body, stream=True), timeout=120
        ).text
        events = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
        assert len(events) > 2 and events[-1]["text"] == alone["text"]
    messages = [{"role": "user", "content": "What is two plus two?"}]
    alone = openai.OpenAI(base_url=prefill.url + "/v1", api_key="x")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x")
    kwargs = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0}
    want = alone.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == want
    pieces = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want
    after = settled(decode)
    assert after["prefill_tokens_computed"] == before["prefill_tokens_computed"]
    assert after["disaggregation_transfers"] - before["disaggregation_transfers"] == 6
    settled(prefill)


def test_client_leaving_between_the_phases_frees_both_servers(pd, router):
    prefill, _, decode = pd
    body = {"text": story(150, salt=2), "sampling_params": GREEDY, "stream": True}
    with requests.post(router.url + "/generate", json=body, stream=True, timeout=60) as answer:
        time.sleep(0.3)  # the prompt is being prefilled in 32-token chunks
        answer.close()  # gone before the first token
    settled(prefill)
    settled(decode)
    again = requests.post(router.url + "/generate", json=dict(body, stream=False), timeout=60)
    assert again.status_code == 200, again.text


def test_prefill_server_dying_fails_the_request_cleanly(pd, router):
    prefill, _, decode = pd
    body = {"text": story(150, salt=3), "sampling_params": GREEDY}
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(requests.post, router.url + "/generate", json=body, timeout=60)
        deadline = time.monotonic() + 30
        while info(decode).get("disaggregation_receiving_requests", 0) == 0:
            assert time.monotonic() < deadline, "the decode server never asked for the pages"
            time.sleep(0.05)
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait()
        failed = answer.result()
    assert failed.status_code == 502, failed.text
    assert "prefill" in failed.json()["error"]["message"]
    settled(decode)
