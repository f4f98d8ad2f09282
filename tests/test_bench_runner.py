"""The benchmark suite's measurement: the ideal hit rate, call recording, and the Engine runner.

The ideal hit rate is checked on hand-made token sequences; the Engine runner on a tiny
shared-prefix workload, where its cache hit rate must be the runtime's own counters (diffed over
the run) with the ideal computed beside it.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

import sglite as sgl
from benchmarks.bench_spec import LLAMA_SPEC, llama_speculation, ngram_ceiling
from benchmarks.ideal_cache import CallLog, ideal_counts, ideal_hit_rate, record_native_backend
from benchmarks.programs.base import Workload
from benchmarks.runners.gbnf import regex_to_gbnf


# ---------------------------------------------------------------------------- ideal hit rate
def test_ideal_empty_and_first_call():
    assert ideal_hit_rate([]) == 0.0
    assert ideal_hit_rate([([1, 2, 3], [4])]) == 0.0  # nothing cached before the first call


def test_ideal_repeat_keeps_last_token_uncached():
    # The same prompt twice: all but the last token of the second is reusable.
    assert ideal_counts([([1, 2, 3, 4], []), ([1, 2, 3, 4], [])]) == (3, 8)


def test_ideal_reuses_previous_output():
    # A multi-turn follow-up: prompt_2 = prompt_1 + output_1 + more.
    calls = [([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 5, 6], [7])]
    assert ideal_counts(calls) == (5, 9)
    assert ideal_hit_rate(calls) == pytest.approx(5 / 9)


def test_ideal_divergence_and_best_earlier_match():
    # Matches stop where the sequences diverge; the best of all earlier calls counts.
    calls = [([1, 2], []), ([1, 3, 4], []), ([1, 3, 4, 5], []), ([1, 2, 9, 9], [])]
    # call 2: [1] of [1,2]; call 3: [1,3,4]; call 4: [1,2]
    assert ideal_counts(calls) == (1 + 3 + 2, 2 + 3 + 4 + 4)


def test_ideal_is_causal():
    # A later call cannot serve an earlier one: order matters.
    long, short = [1, 2, 3, 4, 5], [1, 2, 3]
    assert ideal_counts([(long, []), (short, [])]) == (2, 8)
    assert ideal_counts([(short, []), (long, [])]) == (3, 8)


def test_ideal_shared_prefix_batch():
    # 4 requests = 10 shared + 2 own tokens: (3 x 10) / (4 x 12).
    calls = [(list(range(10)) + [100 + i, 200 + i], [300]) for i in range(4)]
    assert ideal_hit_rate(calls) == pytest.approx(30 / 48)


# ------------------------------------------------------------------- n-gram draft ceiling
def test_ngram_ceiling_of_a_verbatim_copy_is_the_draft_cap_plus_one():
    context = list(range(100, 140))
    # Each forward: 8 drafted tokens accepted plus the model's own: 40 tokens in 5 forwards.
    assert ngram_ceiling(context, context, cap=8) == 40 / 5


def test_ngram_ceiling_of_new_text_is_one_token_per_forward():
    assert ngram_ceiling([1, 2, 3], [7, 8, 9, 10], cap=8) == 1.0


def test_ngram_ceiling_drafts_from_the_best_earlier_match_and_the_answer_itself():
    # [5, 6] follows 4 once and [5, 9, 9] another time: after 4 the best match is the longer
    # one, whichever comes last; the answer's second half repeats its first.
    context = [4, 5, 6, 0, 4, 5, 9, 9]
    answer = [4, 5, 9, 9, 1, 4, 5, 9, 9, 1]
    # Forwards: [4, 5, 9, 9 (drafted) + 1], [4, 5, 9, 9, 1 (drafted, from the answer)] -> 2.
    assert ngram_ceiling(context, answer, cap=8) == 10 / 2


def test_call_log_tokenizes_and_counts_generated_outputs_only():
    log = CallLog()
    log.add("abc", "de")
    log.add("abcdef", "")
    log.add("abx", "yz", generated=False)  # a scored select choice: not output
    encode = lambda text: [ord(c) for c in text]  # noqa: E731 (one character per token)
    assert log.output_tokens(encode) == 2
    # call 2 reuses "abcde" (5 of 6), call 3 reuses "ab" (2 of 3).
    assert log.ideal_hit_rate(encode) == pytest.approx(7 / 12)


def test_record_native_backend_lists_and_n():
    class Fake:
        def _request(self, payload: dict[str, Any]) -> Any:
            text = payload["text"]
            if isinstance(text, list):
                return [{"text": t.upper()} for t in text]
            n = payload["sampling_params"].get("n", 1)
            out = [{"text": f"{text}-{i}"} for i in range(n)]
            return out if n > 1 else out[0]

    backend, log = Fake(), CallLog()
    record_native_backend(backend, log)
    backend._request({"text": ["a", "b"], "sampling_params": {}})
    backend._request({"text": "p", "sampling_params": {"n": 2}})
    assert [(c.prompt, c.output) for c in log.calls] == [
        ("a", "A"), ("b", "B"), ("p", "p-0"), ("p", "p-1"),
    ]  # fmt: skip


def test_regex_to_gbnf():
    assert regex_to_gbnf(r"(10|[1-9])") == 'root ::= (("10" | [1-9]))\n'
    assert regex_to_gbnf(r"[a-z]{1,3}x") == 'root ::= ([a-z]){1,3} "x"\n'
    assert regex_to_gbnf(r"(?=a)b") is None  # look-ahead: not expressible


# ---------------------------------------------------------------------------- Engine runner
SYSTEM_PROMPT = "You are a terse assistant who answers questions about rivers. " * 6


@sgl.function
def _tiny(s, question):
    s += SYSTEM_PROMPT + "\nQuestion: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=4, temperature=0)
    s += "\nIs that right?" + sgl.select("verdict", choices=["yes", "no"])


def _check(state: Any, args: dict[str, Any]) -> None:
    assert isinstance(state["answer"], str), "answer"
    assert state["verdict"] in ("yes", "no"), "verdict"


TINY = Workload(
    name="tiny",
    description="a shared system prompt, one gen and one select",
    program=_tiny,
    make_args=lambda n, seed: [{"question": f"How long is river {seed}-{i}?"} for i in range(n)],
    check=_check,
    shared_prefix=True,
    default_num_requests=3,
    quick_num_requests=3,
)


@pytest.fixture(scope="module")
def engine_system(engine):
    from benchmarks.runners.sglite_engine import EngineSystem

    system = EngineSystem("sglite", engine=engine)
    system.start()
    yield system
    system.stop()


def test_engine_runner_hit_rate_from_runtime_counters(engine_system, monkeypatch):
    seen: list[dict[str, Any]] = []
    inner = engine_system.backend.get_server_info

    def spy() -> dict[str, Any]:
        info = inner()
        seen.append(info)
        return info

    monkeypatch.setattr(engine_system.backend, "get_server_info", spy)
    row = engine_system.run(TINY, 3)
    assert row.system == "sglite" and row.workload == "tiny"
    assert row.programs == 3 and row.failed == 0, row.errors
    assert row.wall_s > 0 and row.programs_per_s > 0 and row.p50_latency_s > 0
    assert row.output_tokens > 0
    # The hit rate is exactly the diff of the runtime's counters around the run...
    before, after = seen[0], seen[-1]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    queried = after["queried_prompt_tokens"] - before["queried_prompt_tokens"]
    assert queried > 0
    assert row.cache_hit_rate == pytest.approx(cached / queried)
    # ...nonzero on a shared-prefix workload, with the ideal beside it.
    assert row.cache_hit_rate > 0.3
    assert 0.3 < row.ideal_hit_rate <= 1.0
    assert row.cache_hit_rate <= row.ideal_hit_rate + 0.05


# ---------------------------------------------------------------------------- bench_spec's peers
def test_llama_cpp_runs_the_same_draft_model_pair_or_its_ngram_types(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    args = argparse.Namespace(algorithm="draft", draft_model_path=str(draft), num_draft_tokens=6)
    configs = llama_speculation(args, threads=2)
    assert sorted(configs) == ["draft model, n-max 3", "draft model, n-max 6"]
    for flags in configs.values():
        assert flags[flags.index("-md") + 1] == str(draft)
        assert flags[flags.index("--spec-type") + 1] == "draft-simple"
    assert configs["draft model, n-max 6"][-2:] == ("--spec-draft-n-max", "6")
    ngram = argparse.Namespace(algorithm="ngram", draft_model_path=None, num_draft_tokens=8)
    assert llama_speculation(ngram, threads=2) == LLAMA_SPEC
