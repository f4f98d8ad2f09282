"""The page at `/` in a real headless browser against the real server: it loads cleanly, a chat
message streams its answer, Stop aborts the request on the server, the cache view draws a node
for a prompt sent through the API, and model output containing HTML shows as text. (With an API
key: tests/test_server_lifecycle.py.) The snapshot behind the cache view is checked directly too."""

from __future__ import annotations

import json

import openai
import pytest
import requests
import torch
from browser_fixtures import console_errors, wait_for
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tree_view import snapshot_tree

pytestmark = pytest.mark.usefixtures("page")


@pytest.fixture(scope="module")
def page(browser, sglite_server):
    """The page loaded once for the module, connected to the shared server (the browser's
    console log is emptied first: an earlier page's messages are not this page's)."""
    browser.get("about:blank")
    console_errors(browser)
    # An empty tree: on the shared server earlier tests' nodes could fill the view's 150 nodes.
    requests.post(sglite_server.url + "/flush_cache", timeout=30).raise_for_status()
    browser.get(sglite_server.url + "/")
    model = requests.get(sglite_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    wait_for(lambda: browser.find_element(By.ID, "model-name").text == model, what="the model")
    return browser


def _text(browser, element_id: str) -> str:
    return browser.find_element(By.ID, element_id).text


def _set(browser, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _answers(browser) -> list:
    return browser.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def _send(browser, prompt: str, *, max_tokens: int, temperature: float = 0.0) -> object:
    """Type `prompt` into a new chat, send it, and return the answer's element."""
    browser.find_element(By.ID, "clear").click()
    _set(browser, "temperature", str(temperature))
    _set(browser, "max-tokens", str(max_tokens))
    _set(browser, "prompt", prompt)
    browser.find_element(By.ID, "send").click()
    return wait_for(lambda: _answers(browser), what="the answer's box")[-1]


def _texts(browser, selector: str) -> list[str]:
    """The text of every element `selector` matches, read in one script (the cache view is
    redrawn every poll, so element handles go stale)."""
    script = "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)"
    return browser.execute_script(script, selector)


def _running(server) -> int:
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    return info["num_running_reqs"]


def test_the_page_loads_without_console_errors(page, sglite_server):
    assert console_errors(page) == []
    assert page.title == "sglite"
    assert not page.find_element(By.ID, "send").get_attribute("disabled")
    assert page.find_element(By.ID, "key-panel").get_attribute("hidden")  # no key needed
    wait_for(lambda: _text(page, "hit-rate").endswith("%"), what="the cache statistics")


def test_a_chat_message_streams_its_answer(page, sglite_server):
    prompt = "List the numbers from one to twenty in words."
    answer = _send(page, prompt, max_tokens=40)
    content = answer.find_element(By.CLASS_NAME, "content")
    seen = set()
    while "streaming" in answer.get_attribute("class"):
        seen.add(content.text)
    seen.discard("")
    assert len(seen) >= 2, "the answer should appear piece by piece while it streams"
    client = openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="none", max_retries=0)
    want = client.chat.completions.create(
        model=_text(page, "model-name"),
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=40,
    )
    assert content.text == want.choices[0].message.content.strip()
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    for part in ("prompt tokens", "cached", "first token", "tokens/s", "40 tokens"):
        assert part in stats, stats
    assert console_errors(page) == []


def test_stop_aborts_the_request_on_the_server(page, sglite_server):
    answer = _send(page, "Write a very long story about a lighthouse.", max_tokens=3000)
    content = answer.find_element(By.CLASS_NAME, "content")
    wait_for(lambda: content.text, what="the first tokens")
    assert _running(sglite_server) == 1
    # While it runs, the cache view shows its prefix locked.
    wait_for(lambda: _texts(page, "#tree .lock"), what="a locked node")
    page.find_element(By.ID, "stop").click()
    wait_for(lambda: _running(sglite_server) == 0, timeout=15, what="the server to abort it")
    assert answer.find_element(By.CLASS_NAME, "stats").text == "stopped"
    assert not page.find_element(By.ID, "send").get_attribute("disabled")
    stopped_at = content.text
    assert len(stopped_at.split()) < 1500
    info = requests.get(sglite_server.url + "/get_server_info", timeout=30).json()
    assert info["kv_invariants"]["ok"], info["kv_invariants"]


def test_the_cache_view_draws_a_prompt_sent_through_the_api(page, sglite_server):
    requests.post(sglite_server.url + "/flush_cache", timeout=30).raise_for_status()
    text = "Quokkas photographed on Rottnest Island look as if they are smiling."
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    requests.post(sglite_server.url + "/generate", json=body, timeout=60).raise_for_status()
    node = wait_for(
        lambda: [t for t in _texts(page, "#tree .node") if "Quokkas" in t],
        what="a node holding the prompt",
    )[0]
    assert " tok" in node and " hits" in node and "device" in node
    # Asked again, the prompt is matched: the path down to its node is highlighted.
    requests.post(sglite_server.url + "/generate", json=body, timeout=60).raise_for_status()
    wait_for(
        lambda: any("Quokkas" in t for t in _texts(page, "#tree .node.on-path")),
        what="the matched path highlighted",
    )
    assert "came from the cache" in _text(page, "last-request")


def test_the_cache_view_shows_segment_reuse(page, sglite_server):
    """A passage marked for reuse, sent in two prompts at different places: the second takes
    its KV from the cached segment, and the page says so (the counter and the last request)."""
    client = openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="unused", max_retries=0)
    passage = "Wombats leave cube-shaped droppings, which they stack to mark their ground. "
    for lead in ("Answer briefly.", "Answer from the passage, in a few words."):
        messages = [
            {"role": "system", "content": lead},
            {"role": "user", "content": passage, "reuse": True},
            {"role": "user", "content": "What shape are the droppings?"},
        ]
        client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    info = requests.get(sglite_server.url + "/get_server_info", timeout=30).json()
    assert info["segment_reused_tokens"] > 0
    last = lambda: _text(page, "last-request")  # noqa: E731
    note = wait_for(
        lambda: "Reused segments gave" in last() and last(), what="the last segment reuse"
    )
    reused = int(note.split("Reused segments gave ")[1].split()[0])
    assert reused > 0
    shown = _text(page, "segment-reused").split()[0]
    assert int(shown) >= reused


def test_model_output_containing_html_shows_as_text(page):
    markup = '<script>window.pwned=1;</script><img src=x onerror="window.pwned=2">'
    Select(page.find_element(By.ID, "constraint-kind")).select_by_value("regex")
    _set(page, "constraint", markup.replace(".", "\\."))
    try:
        answer = _send(page, "Say something.", max_tokens=64)
        wait_for(lambda: "streaming" not in answer.get_attribute("class"), what="the answer")
    finally:
        Select(page.find_element(By.ID, "constraint-kind")).select_by_value("none")
    assert answer.find_element(By.CLASS_NAME, "content").text == markup
    assert page.find_elements(By.CSS_SELECTOR, "#messages script, #messages img") == []
    assert page.execute_script("return window.pwned") is None


def test_a_json_schema_constrains_the_answer(page):
    kind = Select(page.find_element(By.ID, "constraint-kind"))
    kind.select_by_value("json_schema")
    try:
        _set(page, "constraint", "{not json")
        answer = _send(page, "Pick a number.", max_tokens=40)
        error = wait_for(lambda: answer.find_elements(By.CLASS_NAME, "error"), what="an error")
        assert "not valid JSON" in error[0].text
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        _set(page, "constraint", json.dumps(schema))
        answer = _send(page, "Pick a number.", max_tokens=40)
        wait_for(lambda: "streaming" not in answer.get_attribute("class"), what="the answer")
    finally:
        kind.select_by_value("none")
    value = json.loads(answer.find_element(By.CLASS_NAME, "content").text)
    assert isinstance(value["n"], int)


def test_the_tree_endpoint_is_bounded_and_checks_its_arguments(sglite_server):
    url = sglite_server.url + "/cache/tree"
    for text in ("One fish, two fish.", "Red fish, blue fish.", "One fish, red fish."):
        body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
        requests.post(sglite_server.url + "/generate", json=body, timeout=60).raise_for_status()
    small = requests.get(url, params={"max_nodes": 2, "depth": 1}, timeout=30).json()
    assert len(small["nodes"]) == 2 and small["truncated"]
    assert small["nodes"][0]["tier"] == "root" and small["nodes"][0]["hidden_children"] >= 1
    assert small["stats"]["max_total_num_tokens"] == 8192
    bad = [({"depth": 0}, "depth"), ({"max_nodes": 100000}, "max_nodes"),
           ({"text_tokens": -1}, "text_tokens"), ({"replica": 1}, "replica")]  # fmt: skip
    for params, field in bad:
        r = requests.get(url, params=params, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_snapshot_keeps_to_its_bounds_and_follows_the_matched_path():
    pool = KVPool(64, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool)
    for ids in ([1, 2, 3, 4], [1, 2, 5], [6, 7], [8], [9]):
        cache.insert(ids, pool.alloc(len(ids)))
    for _ in range(3):
        cache.match_prefix([6, 7])
    matched = cache.match_prefix([1, 2, 5]).node
    decode = lambda ids: "".join(f"<{i}>" for i in ids)
    full = snapshot_tree(cache, decode, depth=8, max_nodes=100, text_tokens=1, highlight=matched)
    by_id = {n["id"]: n for n in full["nodes"]}
    assert len(full["nodes"]) == 7 and not full["truncated"]  # root, [1 2], [3 4], [5], 3 more
    assert [by_id[i]["text"] for i in full["highlight"]] == ["", "<1>", "<5>"]
    assert by_id[full["highlight"][1]]["text_truncated"]  # [1, 2] shown as its first token
    assert by_id[full["highlight"][1]]["tokens"] == 2
    first = full["nodes"][1]
    assert first["text"] == "<6>" and first["hits"] == 3  # most hits first
    bounded = snapshot_tree(cache, decode, depth=1, max_nodes=3, text_tokens=4)
    assert len(bounded["nodes"]) == 3 and bounded["truncated"]
    assert bounded["nodes"][0]["hidden_children"] == 2  # 4 children, 2 shown
    cache.evict(100)
    assert (
        snapshot_tree(cache, decode, depth=8, max_nodes=9, text_tokens=4, highlight=matched)[
            "highlight"
        ]
        == []
    )
    with pytest.raises(ValueError, match="max_nodes must be between 1 and 2000"):
        snapshot_tree(cache, decode, depth=8, max_nodes=0, text_tokens=4)
