"""A second server instance: API key, overload (503), SIGTERM, and the CLI entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import openai
import pytest
import requests
from browser_fixtures import wait_for
from selenium.webdriver.common.by import By
from server_fixtures import ServerProcess

KEY = "test-secret-key"


@pytest.fixture(scope="module")
def keyed_server():
    """An API-key server that takes at most 2 requests in flight; the last test stops it."""
    server = ServerProcess(
        "--max-queued-requests", "2", "--graceful-shutdown-timeout", "8", api_key=KEY
    )
    yield server
    server.stop()


def test_api_key_guards_every_route_but_health(keyed_server):
    url = keyed_server.url
    assert requests.get(url + "/health", timeout=10).status_code == 200
    routes = [("GET", "/get_model_info"), ("GET", "/get_server_info"), ("GET", "/metrics"),
              ("GET", "/v1/models"), ("POST", "/generate"), ("POST", "/flush_cache"),
              ("GET", "/health_generate"), ("POST", "/v1/chat/completions")]  # fmt: skip
    for method, path in routes:
        r = requests.request(method, url + path, json={}, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer wrong"}
        assert requests.request(method, url + path, headers=wrong, timeout=10).status_code == 401
    ok = requests.get(url + "/get_model_info", headers=keyed_server.headers, timeout=10)
    assert ok.status_code == 200
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    r = requests.post(url + "/generate", json=body, headers=keyed_server.headers, timeout=60)
    assert r.status_code == 200


def test_api_key_with_openai_client(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    model = good.models.list().data[0].id
    r = good.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_the_web_ui_asks_for_the_api_key_and_chats_only_with_it(keyed_server, browser):
    url = keyed_server.url
    assert requests.get(url + "/cache/tree", timeout=10).status_code == 401
    browser.get(url + "/")  # the page shell is public; nothing behind it is
    element = lambda name: browser.find_element(By.ID, name)
    wait_for(lambda: element("key-panel").is_displayed(), what="the API key form")
    assert element("model-name").text == "API key required"
    assert element("send").get_attribute("disabled")
    element("api-key").send_keys("wrong")
    element("save-key").click()
    wait_for(lambda: element("model-name").text == "the API key was refused", what="refusal")
    assert element("send").get_attribute("disabled")
    element("api-key").clear()
    element("api-key").send_keys(KEY)
    element("save-key").click()
    model = requests.get(url + "/v1/models", headers=keyed_server.headers, timeout=10).json()
    wait_for(lambda: element("model-name").text == model["data"][0]["id"], what="the model")
    assert not element("key-panel").is_displayed() and not element("send").get_attribute("disabled")
    for name, value in (("max-tokens", "4"), ("temperature", "0")):
        element(name).clear()
        element(name).send_keys(value)
    element("prompt").send_keys("Hi")
    element("send").click()
    stats = lambda: browser.find_elements(By.CSS_SELECTOR, "#messages .assistant .stats")
    wait_for(lambda: stats() and "4 tokens" in stats()[-1].text, what="the answer's numbers")
    wait_for(lambda: element("hit-rate").text.endswith("%"), what="the cache view, with the key")
    browser.get("about:blank")  # stop polling a server the last test stops


def _open_stream(url: str, headers: dict, started: threading.Event, stop: threading.Event):
    body = {"text": "Tell a story:", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}  # fmt: skip
    with requests.post(
        url + "/generate", json=body, headers=headers, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_overload_answers_503_with_retry_after(keyed_server):
    url, headers = keyed_server.url, keyed_server.headers
    stop = threading.Event()
    events = [threading.Event() for _ in range(2)]
    threads = [
        threading.Thread(target=_open_stream, args=(url, headers, e, stop), daemon=True)
        for e in events
    ]
    for t in threads:
        t.start()
    try:
        for e in events:
            assert e.wait(60)
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(url + "/generate", json=body, headers=headers, timeout=30)
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert "max-queued-requests" in r.json()["error"]["message"]
        r = requests.post(
            url + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30
        )
        assert r.status_code == 503
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    deadline = time.monotonic() + 30
    while True:  # the abandoned streams are aborted, and the server serves again
        info = requests.get(url + "/get_server_info", headers=headers, timeout=30).json()
        if info["num_in_flight_reqs"] == 0 and info["num_running_reqs"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    assert info["kv_invariants"]["held_by_requests"] == 0
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(url + "/generate", json=body, headers=headers, timeout=60).ok


def test_sigterm_drains_then_stops_server_and_scheduler(keyed_server):
    """Runs last in this module: it stops the keyed server. A request that ends within the
    drain (--graceful-shutdown-timeout 8) completes; a longer stream is aborted after it."""
    children = keyed_server.child_pids()
    assert children, "the scheduler process should be a child of the server"
    chunks: list[bytes] = []
    started = threading.Event()
    short: dict = {}

    def short_request() -> None:
        body = {"text": "Count:", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        r = requests.post(
            keyed_server.url + "/generate", json=body, headers=keyed_server.headers, timeout=120
        )
        short.update(status=r.status_code, body=r.json())

    def stream() -> None:
        body = {"text": "Once", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}  # fmt: skip
        url, headers = keyed_server.url, keyed_server.headers
        with requests.post(
            url + "/generate", json=body, headers=headers, stream=True, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    started.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(60)
    t_short = threading.Thread(target=short_request, daemon=True)
    t_short.start()
    deadline = time.monotonic() + 30
    while True:  # both requests are in flight when the signal arrives
        info = requests.get(
            keyed_server.url + "/get_server_info", headers=keyed_server.headers, timeout=30
        ).json()
        if info["num_in_flight_reqs"] == 2:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    t0 = time.monotonic()
    keyed_server.proc.terminate()
    time.sleep(0.5)
    # Draining: no new work is taken.
    with pytest.raises(requests.RequestException):
        requests.get(keyed_server.url + "/health", timeout=5).raise_for_status()
    code = keyed_server.proc.wait(60)
    assert code == 0, keyed_server.output()[-3000:]
    assert 7.5 < time.monotonic() - t0 < 45
    t.join(30)
    t_short.join(30)
    assert not t.is_alive() and not t_short.is_alive()
    assert short["status"] == 200, short
    assert short["body"]["meta_info"]["finish_reason"]["type"] == "length"
    assert short["body"]["meta_info"]["completion_tokens"] == 4
    # The in-flight stream ended with an abort error, then [DONE].
    assert chunks[-1] == b"data: [DONE]"
    assert b"shutting down" in chunks[-2]
    for pid in children:
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and _is_running(pid):
            assert time.monotonic() < deadline, f"scheduler {pid} outlived the server"
            time.sleep(0.1)
    assert "sglite is ready" in keyed_server.output()


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_cli_help_lists_server_flags():
    for cmd in ([sys.executable, "-m", "sglite.launch_server", "--help"],
                [sys.executable, "-m", "sglite.cli", "serve", "--help"]):  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        for flag in ("--model-path", "--host", "--port", "--api-key", "--dtype", "--device",
                     "--max-running-requests", "--chunked-prefill-size", "--schedule-policy",
                     "--disable-radix-cache", "--context-length", "--log-level",
                     "--max-queued-requests", "--max-total-tokens"):  # fmt: skip
            assert flag in out.stdout, (cmd, flag)


def test_cli_rejects_bad_flags_without_loading():
    cmd = [sys.executable, "-m", "sglite.cli", "serve", "--schedule-policy", "random"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "schedule-policy" in out.stderr
    cmd = [sys.executable, "-m", "sglite.cli", "serve", "--max-running-requests", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "max_running_requests" in out.stderr
