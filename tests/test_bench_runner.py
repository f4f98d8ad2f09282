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
from benchmarks.ideal_cache import CallLog, ideal_counts, ideal_hit_rate, record_native_backend
from benchmarks.programs.base import Workload
from benchmarks.runners.gbnf import regex_to_gbnf
from benchmarks.spec_llama_peer import LLAMA_SPEC, llama_speculation
from benchmarks.spec_measure import ngram_ceiling


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


# ---------------------------------------------------------------------------- crashed peers
# Real processes standing in for llama.cpp: one that segfaults at once (as llama.cpp's native
# build does in its AMX path on some Intel hosts), one that answers /health and then segfaults
# on its first request (a crash mid-run).
SEGFAULT_NOW = "#!/bin/sh\nkill -SEGV $$\n"
SEGFAULT_ON_REQUEST = """\
import http.server, os, signal, sys

port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        os.kill(os.getpid(), signal.SIGSEGV)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_llama(folder, script: str, build: str | None = None) -> str:
    """A folder holding `llama-server` and `llama-bench` running `script` (and a BUILD record)."""
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    if not script.startswith("#!"):
        script = f"#!{sys.executable}\n{script}"
    for name in ("llama-server", "llama-bench"):
        (folder / name).write_text(script)
        (folder / name).chmod(0o755)
    if build is not None:
        (folder / "BUILD").write_text(build)
    return str(folder / "llama-server")


@pytest.fixture
def crashing_llama(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept crash logs land here
    return _fake_llama(tmp_path / "crash", SEGFAULT_NOW, "native crashed; -DGGML_NATIVE=OFF\n")


def test_peer_status_names_the_exit_signal_and_the_log():
    from benchmarks.common import PeerStatus

    crashed = PeerStatus("llama-server", "crashed", -11, "/tmp/x.log", "at start-up", build="b")
    assert crashed.cell() == "crashed at start-up (exit -11 SIGSEGV, log: /tmp/x.log)"
    assert crashed.line() == "llama-server [b]: " + crashed.cell() and not crashed.ok
    assert PeerStatus("x", "skipped", reason="no binary").cell() == "skipped (no binary)"
    assert PeerStatus("x").cell() == "ok"


def test_the_build_scripts_llama_cpp_comes_before_one_on_path(tmp_path, monkeypatch):
    from benchmarks.runners.llama_cpp import find_llama_server, llama_build_line

    built = _fake_llama(tmp_path / "sglite" / "llama.cpp" / "bin", SEGFAULT_NOW, "native crashed\n")
    on_path = _fake_llama(tmp_path / "path", SEGFAULT_NOW)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert find_llama_server(None) == (built, "built by benchmarks/build_llama_cpp.sh")
    assert llama_build_line(built) == "build without AMX: native crashed"
    assert "configuration unknown" in llama_build_line(on_path)


def test_bench_spec_reports_a_llama_server_that_crashes_at_start(crashing_llama, capsys):
    from benchmarks.spec_llama_peer import start_llama
    from benchmarks.spec_measure import Tally
    from benchmarks.spec_table import WorkloadResult, print_table

    args = argparse.Namespace(
        no_llama=False, llama_server=crashing_llama, algorithm="ngram", draft_model_path=None
    )
    peers = start_llama(args, "model.gguf")
    assert not peers.servers and set(peers.status) == {"off", *LLAMA_SPEC}
    row = WorkloadResult("copy", Tally([10.0]), Tally([20.0]), 2.0, [2.0], 1.5, True, 2.0)
    print_table(args, [row], peers)
    out = capsys.readouterr().out
    table_row = next(line for line in out.splitlines() if line.startswith("| copy"))
    assert "llama.cpp off crashed at start-up (exit -11 SIGSEGV, log: " in table_row
    assert "build without AMX: native crashed; -DGGML_NATIVE=OFF" in out  # the build, named
    assert out.count("crashed at start-up (exit -11") >= 1 + len(peers.status)  # and each one


def test_bench_serving_reports_a_launched_llama_server_that_crashes(crashing_llama, capsys):
    from benchmarks.bench_serving import main

    code = main(["--launch-llama-cpp", "--llama-server", crashing_llama, "--workload", "random"])
    out = capsys.readouterr().out
    assert code == 1
    assert "server: llama-server [build without AMX: native crashed" in out
    row = next(line for line in out.splitlines() if line.startswith("| random"))
    assert "crashed at start-up (exit -11 SIGSEGV, log: " in row


def test_bench_serving_reports_a_server_that_crashes_mid_run(tmp_path, capsys, monkeypatch):
    import tempfile

    from benchmarks.bench_serving import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    server = _fake_llama(tmp_path / "midrun", SEGFAULT_ON_REQUEST)
    argv = ["--launch-llama-cpp", "--llama-server", server, "--workload", "random"]
    code = main([*argv, "--num-prompts", "2", "--random-input-len", "8"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| random"))
    assert code == 1 and "crashed mid-run (exit -11 SIGSEGV, log: " in row


def test_bench_pd_names_a_process_that_exited(tmp_path):
    import subprocess

    from benchmarks.pd_servers import Proc, statuses

    script = _fake_llama(tmp_path / "pd", SEGFAULT_NOW)
    dead = subprocess.Popen([script])
    dead.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        got = statuses([Proc("decode", dead, "u", "/tmp/d.log"), Proc("colo", alive, "u", "l")])
    finally:
        alive.kill()
        alive.wait()
    assert got[0].cell() == "crashed mid-run (exit -11 SIGSEGV, log: /tmp/d.log)"
    assert got[1].ok
