"""The router's PD disaggregation mode against fake prefill and decode workers.

The fakes are small FastAPI apps served by real uvicorn servers on loopback ports (a thread
each), as is the router itself (built from RouterArgs, in-process): every byte goes through real
sockets, so cancelling a copy of a request is seen by the fake as its client disconnecting.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import requests
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from server_fixtures import free_port

from sglite.router.app import create_app
from sglite.router.args import RouterArgs
from sglite.router.launch import main as router_main
from sglite.router.launch import parse_args
from sglite.router.state import RouterState, build_state

BOOTSTRAP_PORT = 8998
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}


class Served:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeWorker(Served):
    """A PD worker of `role` that records the generation bodies it gets.

    `mode` says how it answers them: "ok" (prefill: a small JSON; decode: its answer, streamed
    when asked), "fail" (500), "bad" (400), "wait" (nothing until the client disconnects, which
    sets `disconnected`). A decode worker with `kv_from` set answers "ok" only once that prefill
    worker got the same bootstrap room (up to 5 s), as a real one waits for the prompt's KV: the
    router answers with the decode's reply and cancels the prefill's request if still unsent.
    """

    kv_from: FakeWorker | None = None

    def __init__(self, role: str, mode: str = "ok", info_role: str | None = None) -> None:
        self.role = role
        self.mode = mode
        self.bodies: list[dict] = []
        self.flushed = 0
        self.disconnected = threading.Event()
        info = {"disaggregation_mode": info_role or role, "model_path": f"fake-{role}"}
        if role == "prefill":
            info["disaggregation_bootstrap_port"] = BOOTSTRAP_PORT
        app = FastAPI()
        app.add_api_route("/health", lambda: Response("OK"))
        app.add_api_route("/get_server_info", lambda: info)
        app.add_api_route("/v1/models", lambda: {"data": [{"id": f"fake-{role}"}]})
        app.add_api_route("/flush_cache", self._flush, methods=["POST"])
        for path in GENERATION_PATHS:
            app.add_api_route(path, self._generate, methods=["POST"])
        super().__init__(app)

    def _flush(self) -> Response:
        self.flushed += 1
        return Response("Cache flushed.\n")

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "wait":
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            self.disconnected.set()
            return Response(status_code=499)
        if self.mode in ("fail", "bad"):
            status = 500 if self.mode == "fail" else 400
            message = f"{self.role} says {self.mode}"
            error = {"message": message, "type": "x", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=status)
        answer = {"text": f"from {self.role}", "room": body.get("bootstrap_room")}
        if self.kv_from is not None:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and all(
                b.get("bootstrap_room") != answer["room"] for b in self.kv_from.bodies
            ):
                await asyncio.sleep(0.01)
        if self.role == "decode" and body.get("stream"):
            return StreamingResponse(_events(answer), media_type="text/event-stream")
        return JSONResponse(answer)


async def _events(answer: dict) -> Any:
    for i in range(3):
        yield f"data: {json.dumps({**answer, 'index': i})}\n\n".encode()
        await asyncio.sleep(0.01)
    yield b"data: [DONE]\n\n"


class Router(Served):
    """The router in PD mode over the given workers (or, with `plain`, in the usual mode over
    those); health checked at start only."""

    def __init__(
        self, prefill: list[str], decode: list[str], plain: list[str] | None = None
    ) -> None:
        options = {"health_check_interval": 60.0, "health_failure_threshold": 1}
        if plain is None:
            options |= {"pd_disaggregation": True, "prefill_urls": prefill, "decode_urls": decode}
        self.state: RouterState = build_state(RouterArgs(worker_urls=plain or [], **options))
        if self.state.pd is not None:
            self.state.pd.grace = 0.5  # the prefill-4xx test waits this long for the decode
        super().__init__(create_app(self.state))

    def workers(self) -> list[dict]:
        return requests.get(self.url + "/list_workers", timeout=10).json()["workers"]

    def assert_idle(self) -> None:
        """Every worker's in_flight is back to 0 (clean-ups may finish just after the answer)."""
        deadline = time.monotonic() + 5
        while any(w["load"] for w in self.workers()):
            assert time.monotonic() < deadline, self.workers()
            time.sleep(0.02)


@pytest.fixture
def pd():
    """A prefill and a decode fake behind a PD router; stopped after the test."""
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    decode.kv_from = prefill
    router = Router([prefill.url], [decode.url])
    yield router, prefill, decode
    for served in (router, prefill, decode):
        served.stop()


def _same_bootstrap(prefill: FakeWorker, decode: FakeWorker) -> dict:
    """The bootstrap fields both fakes got for the one request they saw (asserted equal)."""
    (p,), (d,) = prefill.bodies, decode.bodies
    fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert {k: p[k] for k in fields} == {k: d[k] for k in fields}
    return {k: p[k] for k in fields}


# ---------------------------------------------------------------------------- flags
def test_pd_flags_are_validated(capsys):
    good = ["--prefill", "http://p:1/", "--prefill", "http://p:2", "--decode", "http://d:1"]
    args = parse_args(["--pd-disaggregation", *good], prog="sglite router")
    assert args.pd_disaggregation and args.prefill_urls == ["http://p:1", "http://p:2"]
    assert args.decode_urls == ["http://d:1"] and args.worker_urls == []
    listed = ["--prefill", "http://p:1", "http://p:2", "--decode", "http://d:1"]
    args = parse_args([*listed, "--pd-disaggregation"], prog="sglite router")
    assert args.prefill_urls == ["http://p:1", "http://p:2"]
    cases = [
        ({"prefill_urls": ["http://p:1"]}, "--decode"),
        ({"decode_urls": ["http://d:1"]}, "--prefill"),
        ({"prefill_urls": ["http://a:1"], "decode_urls": ["http://a:1"]}, "two worker lists"),
        ({"prefill_urls": ["http://p:1", "http://p:1"], "decode_urls": ["http://d:1"]}, "twice"),
        ({"worker_urls": ["http://w:1"], "prefill_urls": ["http://p:1"],
          "decode_urls": ["http://d:1"]}, "--worker-urls"),
    ]  # fmt: skip
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            RouterArgs(pd_disaggregation=True, **fields).validate()
    for fields in ({"prefill_urls": ["http://p:1"]}, {"decode_urls": ["http://d:1"]}):
        with pytest.raises(ValueError, match="--pd-disaggregation"):
            RouterArgs(**fields).validate()
    with pytest.raises(SystemExit) as exit_info:
        router_main(["--pd-disaggregation", "--prefill", "http://p:1"], prog="sglite router")
    assert exit_info.value.code == 2 and "--decode" in capsys.readouterr().err


# ---------------------------------------------------------------------------- answers
def test_generate_goes_to_both_and_answers_the_decodes_json(pd):
    router, prefill, decode = pd
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4}}
    r = requests.post(router.url + "/generate", json=body, timeout=10)
    assert r.status_code == 200, r.text
    boot = _same_bootstrap(prefill, decode)
    assert r.json() == {"text": "from decode", "room": boot["bootstrap_room"]}
    assert boot["bootstrap_host"] == "127.0.0.1" and boot["bootstrap_port"] == BOOTSTRAP_PORT
    assert isinstance(boot["bootstrap_room"], int) and 0 <= boot["bootstrap_room"] < 2**63
    assert prefill.bodies[0]["stream"] is False and "stream" not in decode.bodies[0]
    for got in (prefill.bodies[0], decode.bodies[0]):
        assert got["text"] == body["text"] and got["sampling_params"] == body["sampling_params"]
    router.assert_idle()
    # A second request gets a room of its own.
    requests.post(router.url + "/generate", json=body, timeout=10)
    assert prefill.bodies[1]["bootstrap_room"] != boot["bootstrap_room"]
    assert prefill.bodies[1]["bootstrap_room"] == decode.bodies[1]["bootstrap_room"]


def test_streamed_chat_relays_the_decodes_events(pd):
    router, prefill, decode = pd
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(
        router.url + "/v1/chat/completions", json=body, stream=True, timeout=10
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    boot = _same_bootstrap(prefill, decode)
    assert events[-1] == "[DONE]" and len(events) == 4
    assert [json.loads(e)["index"] for e in events[:-1]] == [0, 1, 2]
    assert all(json.loads(e)["room"] == boot["bootstrap_room"] for e in events[:-1])
    assert prefill.bodies[0]["stream"] is False and "stream_options" not in prefill.bodies[0]
    assert decode.bodies[0]["stream"] is True and decode.bodies[0]["stream_options"]
    assert prefill.bodies[0]["messages"] == decode.bodies[0]["messages"] == CHAT["messages"]
    router.assert_idle()
    # Non-streamed completions too.
    r = requests.post(router.url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
    assert r.status_code == 200 and r.json()["text"] == "from decode"
    router.assert_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_still_running_after_the_decodes_answer_is_cancelled(pd, stream):
    router, prefill, decode = pd
    prefill.mode = "wait"  # its answer never comes: the decode's is all that matters
    r = requests.post(router.url + "/generate", json={"text": "x", "stream": stream}, timeout=10)
    assert r.status_code == 200 and "from decode" in r.text
    assert r.text.endswith("data: [DONE]\n\n") if stream else r.json()["text"] == "from decode"
    assert prefill.disconnected.wait(5), "the prefill request was left running"
    router.assert_idle()


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_cancels_the_decode(pd, stream):
    router, prefill, decode = pd
    prefill.mode, decode.mode = "fail", "wait"
    r = requests.post(router.url + "/generate", json={"text": "x", "stream": stream}, timeout=10)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "prefill_failed" and prefill.url in error["message"]
    assert "prefill says fail" in error["message"]
    assert decode.disconnected.wait(5), "the decode request was not cancelled"
    router.assert_idle()


def test_prefill_4xx_answers_the_decodes_answer_or_its_own(pd):
    router, prefill, decode = pd
    prefill.mode = decode.mode = "bad"
    r = requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "decode says bad"
    router.assert_idle()
    decode.mode = "wait"  # the decode has no answer within the grace period
    r = requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prefill says bad"
    assert decode.disconnected.wait(5)
    router.assert_idle()


def test_decode_failure_answers_502_and_cancels_the_prefill(pd):
    router, prefill, decode = pd
    prefill.mode = "wait"
    decode.stop()  # healthy at the last check, gone now
    r = requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "decode_failed" and decode.url in error["message"]
    assert prefill.disconnected.wait(5), "the prefill request was not cancelled"
    router.assert_idle()
    entry = next(w for w in router.workers() if w["url"] == decode.url)
    assert entry["healthy"] is False and entry["role"] == "decode"
    # No healthy decode worker left: 503, and /health says which group is missing.
    r = requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
    assert "decode" in r.json()["error"]["message"]
    r = requests.get(router.url + "/health", timeout=10)
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"]


def test_client_gone_cancels_both_copies(pd):
    router, prefill, decode = pd
    prefill.mode = decode.mode = "wait"
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(router.url + "/generate", json={"text": "x"}, timeout=0.5)
    assert prefill.disconnected.wait(5) and decode.disconnected.wait(5)
    router.assert_idle()


def test_no_healthy_decode_answers_503():
    prefill = FakeWorker("prefill")
    router = Router([prefill.url], [f"http://127.0.0.1:{free_port()}"])
    try:
        for stream in (False, True):
            body = {"text": "x", "stream": stream}
            r = requests.post(router.url + "/generate", json=body, timeout=10)
            assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text
        assert prefill.bodies == []  # nothing was sent to the prefill either
        assert requests.get(router.url + "/health", timeout=10).status_code == 503
        assert requests.get(router.url + "/v1/models", timeout=10).status_code == 503
    finally:
        router.stop()
        prefill.stop()


def test_a_worker_of_the_wrong_role_gets_no_traffic():
    not_prefill = FakeWorker("prefill", info_role="decode")  # says it is a decode server
    decode = FakeWorker("decode")
    router = Router([not_prefill.url], [decode.url])
    try:
        entry = next(w for w in router.workers() if w["role"] == "prefill")
        assert entry["healthy"] is False and "not a prefill server" in entry["last_error"]
        r = requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
        assert r.status_code == 503 and not_prefill.bodies == [] and decode.bodies == []
    finally:
        for served in (router, not_prefill, decode):
            served.stop()


# ---------------------------------------------------------------------------- other routes
def test_management_routes_know_both_groups(pd):
    router, prefill, decode = pd
    listed = requests.get(router.url + "/list_workers", timeout=10).json()
    assert listed["pd_disaggregation"] is True
    assert [(w["url"], w["role"]) for w in listed["workers"]] == [
        (prefill.url, "prefill"), (decode.url, "decode"),
    ]  # fmt: skip
    assert all(w["healthy"] for w in listed["workers"])

    info = requests.get(router.url + "/get_server_info", timeout=10).json()
    assert info["model_path"] == "fake-decode" and info["router"]["pd_disaggregation"] is True
    assert [w["url"] for w in info["router"]["prefill"]] == [prefill.url]
    assert [w["url"] for w in info["router"]["decode"]] == [decode.url]
    models = requests.get(router.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "fake-decode"  # passthrough routes go to a decode worker

    assert requests.post(router.url + "/flush_cache", timeout=10).status_code == 200
    assert prefill.flushed == decode.flushed == 1
    requests.post(router.url + "/generate", json={"text": "metrics"}, timeout=10)
    text = requests.get(router.url + "/metrics", timeout=10).text
    assert f'sglite_router:requests_total{{role="prefill",worker="{prefill.url}"}} 1.0' in text
    assert f'sglite_router:in_flight_requests{{role="decode",worker="{decode.url}"}} 0.0' in text


def test_add_and_remove_workers_by_role(pd):
    router, prefill, decode = pd
    extra = FakeWorker("decode")
    try:
        for query in ({"url": extra.url}, {"url": extra.url, "role": "both"}):
            r = requests.post(router.url + "/add_worker", params=query, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
        r = requests.post(
            router.url + "/add_worker", params={"url": prefill.url, "role": "decode"}, timeout=10
        )
        assert r.status_code == 400 and "prefill worker" in r.json()["error"]["message"]
        r = requests.post(
            router.url + "/add_worker", params={"url": extra.url, "role": "decode"}, timeout=10
        )
        assert r.status_code == 200, r.text
        assert r.json()["worker"]["healthy"] and r.json()["worker"]["role"] == "decode"
        for _ in range(2):  # least load, ties to the least routed: one each
            requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
        assert len(decode.bodies) == len(extra.bodies) == 1
        r = requests.post(
            router.url + "/remove_worker", params={"url": extra.url, "role": "prefill"}, timeout=10
        )
        assert r.status_code == 404
        r = requests.post(
            router.url + "/remove_worker", params={"url": extra.url, "role": "decode"}, timeout=10
        )
        assert r.status_code == 200 and [w["role"] for w in router.workers()] == [
            "prefill", "decode",
        ]  # fmt: skip
    finally:
        extra.stop()


def test_the_usual_mode_is_unchanged():
    worker = FakeWorker("decode")  # answers as a plain worker would (no role checked)
    router = Router([], [], plain=[worker.url])
    try:
        r = requests.post(router.url + "/generate", json={"text": "x"}, timeout=10)
        assert r.status_code == 200 and r.json()["text"] == "from decode"
        assert "bootstrap_room" not in worker.bodies[0]
        r = requests.post(router.url + "/generate", json={"text": "x", "stream": True}, timeout=10)
        assert r.text.endswith("data: [DONE]\n\n")
        listed = requests.get(router.url + "/list_workers", timeout=10).json()
        assert "pd_disaggregation" not in listed and "role" not in listed["workers"][0]
        info = requests.get(router.url + "/get_server_info", timeout=10).json()["router"]
        assert [w["url"] for w in info["workers"]] == [worker.url]
        text = requests.get(router.url + "/metrics", timeout=10).text
        assert f'sglite_router:requests_total{{worker="{worker.url}"}} 2.0' in text
        query = {"url": "http://127.0.0.1:1", "role": "decode"}
        r = requests.post(router.url + "/add_worker", params=query, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "role"
        router.assert_idle()
    finally:
        router.stop()
        worker.stop()
