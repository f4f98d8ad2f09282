"""The in-process Engine on the real default model: API shape, cache reuse, batching, errors."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import sglite

GREEDY = {"temperature": 0, "max_new_tokens": 16}
SHARED = (
    "You are a careful assistant. Answer every question in one short sentence. "
    "Here is some background on the solar system: the Sun is a star; Mercury, Venus, Earth and "
    "Mars are rocky planets; Jupiter and Saturn are gas giants; Uranus and Neptune are ice giants. "
)


def test_generate_single_result_shape(engine):
    out = engine.generate("The capital of France is", GREEDY)
    assert isinstance(out, dict)
    assert isinstance(out["text"], str) and out["text"]
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert key in meta
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 16
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The capital of France is"))
    assert meta["e2e_latency"] > 0


def test_batch_and_input_ids(engine):
    prompts = ["One, two, three,", "A, B, C,"]
    outs = engine.generate(prompts, GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    ids = [engine.tokenizer.encode(p) for p in prompts]
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o["text"] for o in by_ids] == [o["text"] for o in outs]
    one = engine.generate(input_ids=ids[0], sampling_params=GREEDY)
    assert one["output_ids"] == outs[0]["output_ids"]


def test_max_new_tokens_zero_fills_cache(engine):
    prompt = SHARED + "Prefill only, a unique marker 7781."
    out = engine.generate(prompt, {"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    again = engine.generate(prompt + " Then a question?", GREEDY)
    assert again["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 1


def test_shared_prefix_reports_cached_tokens(engine):
    shared_len = len(engine.tokenizer.encode(SHARED))
    prompts = [SHARED + f"Question {i}: what is planet number {i}?" for i in range(1, 5)]
    first = engine.generate(prompts[0], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert first["meta_info"]["prompt_tokens"] > shared_len
    for out in rest:
        assert out["meta_info"]["cached_tokens"] >= shared_len - 1


def test_cache_on_and_off_give_same_outputs(engine, engine_no_cache):
    prompts = [SHARED + f"Tell me about planet {p}." for p in ("Mars", "Venus", "Jupiter")]
    on = engine.generate(prompts, GREEDY)
    on_again = engine.generate(prompts, GREEDY)  # now served from the cache
    off = engine_no_cache.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["output_ids"] for o in on_again] == [o["output_ids"] for o in off]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in off)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in on_again)


def test_multi_turn_reuses_previous_answer(engine):
    turn1 = SHARED + "User: Name a gas giant.\nAssistant:"
    out1 = engine.generate(turn1, {"temperature": 0, "max_new_tokens": 12})
    turn2_ids = (
        engine.tokenizer.encode(turn1)
        + out1["output_ids"]
        + engine.tokenizer.encode("\nUser: And an ice giant?\nAssistant:")
    )
    out2 = engine.generate(input_ids=turn2_ids, sampling_params=GREEDY)
    # Everything up to the first answer's last token (whose K/V was never computed) is reused.
    reused = len(engine.tokenizer.encode(turn1)) + len(out1["output_ids"]) - 1
    assert out2["meta_info"]["cached_tokens"] >= reused


def test_n_greater_than_one_shares_prompt(engine):
    outs = engine.generate(
        SHARED + "Write a word:", {"n": 3, "temperature": 1.0, "seed": 5, "max_new_tokens": 8}
    )
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "seeds per sample must differ"
    assert sum(o["meta_info"]["cached_tokens"] > 0 for o in outs) >= 2


def test_stream_matches_non_stream(engine):
    prompt = "Count from one to ten: one, two,"
    full = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 20})
    chunks = list(engine.generate(prompt, {"temperature": 0, "max_new_tokens": 20}, stream=True))
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text must be cumulative"
    assert texts[-1] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_closed_early_frees_slots(engine):
    gen = engine.generate("Tell me a long story:", {"max_new_tokens": 200}, stream=True)
    next(gen)
    gen.close()  # the autouse fixture then checks that no request holds slots


def test_async_generate(engine):
    async def main():
        single = await engine.async_generate("Hello, my name is", GREEDY)
        many = await asyncio.gather(
            *(engine.async_generate(f"Number {i} is", GREEDY) for i in range(4))
        )
        chunks = [c async for c in await engine.async_generate("Hi", GREEDY, stream=True)]
        return single, many, chunks

    single, many, chunks = asyncio.run(main())
    # The coroutine form answers what the blocking form answers (greedy: the same text).
    assert single["text"] == engine.generate("Hello, my name is", GREEDY)["text"]
    batch = engine.generate([f"Number {i} is" for i in range(4)], GREEDY)
    assert [m["text"] for m in many] == [b["text"] for b in batch]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert chunks[-1]["text"] == engine.generate("Hi", GREEDY)["text"]


def test_chunked_prefill_matches_unchunked(engine, engine_small_pool):
    prompt = SHARED * 3 + "Summarise the above:"
    big = engine.generate(prompt, GREEDY)
    small = engine_small_pool.generate(prompt, GREEDY)  # chunks of 64 tokens
    assert len(engine.tokenizer.encode(prompt)) > 64 * 2
    assert small["output_ids"] == big["output_ids"]


def test_eviction_and_retraction_under_small_pool(engine, engine_small_pool):
    prompts = [
        f"Story {i}: once upon a time, in the land of {w}," for i, w in enumerate("ABCDEFGH")
    ]
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    expected = engine.generate(prompts, params)
    before = engine_small_pool.get_server_info()["retractions"]
    got = engine_small_pool.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert engine_small_pool.get_server_info()["retractions"] > before


def test_64_concurrent_mixed_lengths(engine):
    prompts = [("word " * (1 + (i * 7) % 40)) + f"item {i}:" for i in range(64)]
    params = [
        {"temperature": 0, "max_new_tokens": 1 + i % 8, "ignore_eos": True} for i in range(64)
    ]
    outs = engine.generate(prompts, params)
    assert len(outs) == 64
    for i, out in enumerate(outs):
        assert out["meta_info"]["completion_tokens"] == 1 + i % 8
    for i in (0, 9, 33, 63):  # spot-check against the request run alone
        alone = engine.generate(prompts[i], params[i])
        assert alone["output_ids"] == outs[i]["output_ids"]


def test_server_info_reports_cache_and_pool(engine):
    info = engine.get_server_info()
    for key in ("cache_hit_rate", "pool_usage", "num_running_reqs", "num_queued_reqs"):
        assert key in info
    assert 0 <= info["cache_hit_rate"] <= 1
    assert info["max_total_num_tokens"] == 8192


def test_flush_cache_empties_it(engine):
    engine.generate(SHARED, {"max_new_tokens": 0})
    assert engine.get_server_info()["cache_size_tokens"] > 0
    engine.flush_cache()
    assert engine.get_server_info()["cache_size_tokens"] == 0
    out = engine.generate(SHARED + "Q?", GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"sampling_params": {"bogus_field": 1}}, "bogus_field"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "word " * 9000}, "context length"),
        ({"sampling_params": {"max_new_tokens": 20000}}, "max_new_tokens"),
        ({"input_ids": [1, 2, 10**9]}, "vocabulary"),
    ],
)
def test_bad_input_raises_clear_error(engine, kwargs, message):
    args = {"prompt": "Hello"} if "prompt" not in kwargs and "input_ids" not in kwargs else {}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        engine.generate(**args)
    assert engine.generate("Still serving?", {"max_new_tokens": 2})["meta_info"][
        "completion_tokens"
    ]


def test_engine_process_dies_with_crashing_script(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent(
            """
            import sglite
            eng = sglite.Engine(max_total_tokens=2048)
            print(eng.client.process.pid, flush=True)
            raise SystemExit("user script crashed")  # no shutdown() call
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    pid = int(proc.stdout.strip().splitlines()[-1])
    deadline = time.time() + 15
    while time.time() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "the scheduler process outlived its parent"


def test_engine_process_dies_when_parent_is_killed(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(
        "import sglite, time\n"
        "eng = sglite.Engine(max_total_tokens=2048)\n"
        "print(eng.client.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "the scheduler process outlived a killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_engine_refuses_server_only_options():
    """Options only the HTTP server acts on are an error, not silently ignored."""
    with pytest.raises(TypeError, match="port: server option"):
        sglite.Engine(port=31000)
    with pytest.raises(TypeError, match="api_key, tool_call_parser: server option"):
        sglite.Engine(api_key="k", tool_call_parser="hermes")


def test_max_prefill_tokens_bounds_each_prefill_pass(engine):
    """A 300-token prompt with max_prefill_tokens=64 takes five prefill passes (64 tokens at
    most each), whatever the larger chunked_prefill_size says; the answer does not change."""
    prompt = " ".join(f"w{i}" for i in range(300))
    ids = engine.tokenizer.encode(prompt)[:300]
    engine.flush_cache()
    before = engine.get_server_info()["prefill_passes"]
    whole = engine.generate(input_ids=ids, sampling_params=GREEDY)["text"]
    assert engine.get_server_info()["prefill_passes"] - before == 1
    with sglite.Engine(dtype="float32", max_prefill_tokens=64, log_level="error") as small:
        before = small.get_server_info()["prefill_passes"]
        assert small.generate(input_ids=ids, sampling_params=GREEDY)["text"] == whole
        assert small.get_server_info()["prefill_passes"] - before == 5
