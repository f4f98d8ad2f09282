"""bench_engine's arithmetic: the bytes a decode step reads, the targets it checks, and the
llama.cpp build it names."""

from __future__ import annotations

import pytest

from benchmarks.engine_machine import weight_bytes_per_token
from benchmarks.engine_report import targets
from benchmarks.engine_rows import Row
from benchmarks.engine_sglite import BANDWIDTH_SHARE
from benchmarks.engine_workloads import LONG_DECODE
from benchmarks.runners.llama_cpp import llama_build
from sglite.runtime.model.loader import default_model_path


def test_a_decode_step_reads_every_layer_and_the_output_projection():
    import gguf

    path = default_model_path()
    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    head = sizes.get("output.weight", sizes["token_embd.weight"])
    layers = sum(n for name, n in sizes.items() if name.startswith("blk."))
    assert weight_bytes_per_token(path) == layers + head
    assert head > 0 and layers > head


MACHINE = {"decode_limit": 20.0, "prefill_roofline": 600.0, "batch32_roofline": 400.0}


def _status(lines: list[str], label: str) -> str:
    (line,) = [x for x in lines if x.startswith(f"- {label}")]
    return line.split(": ", 1)[1].split(" ")[0]


def test_targets_compare_sglite_with_the_bars_the_speed_issue_sets():
    rows = [
        Row("batch-1 decode", "sglite bfloat16 q4_k+q6_k a8", 17.5, "tok/s"),
        Row(BANDWIDTH_SHARE, "sglite bfloat16 q4_k+q6_k a8", 86.0, "%"),
        Row("batch-1 decode", "llama.cpp build without AMX", 16.0, "tok/s"),
        Row(LONG_DECODE, "sglite bfloat16 q4_k+q6_k a8", 14.0, "tok/s"),
        Row(LONG_DECODE, "llama.cpp build without AMX", 10.0, "tok/s"),
        Row("prefill 1000 tokens", "sglite bfloat16 q4_k+q6_k a8", 430.0, "tok/s"),
        Row("prefill 1000 tokens", "transformers bfloat16", 200.0, "tok/s"),
        Row("32 concurrent decode", "sglite bfloat16 q4_k+q6_k a8", 150.0, "out tok/s"),
    ]
    lines = targets(rows, MACHINE)
    # Against the read rate measured around the decode run, not the start's limit (20 tok/s).
    assert _status(lines, "batch-1 decode >= 85% of the bandwidth limit") == "MET"
    assert _status(lines, "batch-1 decode >= 1.1x llama.cpp") == "MISSED"  # 17.6 bar
    assert _status(lines, LONG_DECODE) == "MET"  # 12.5 bar
    assert _status(lines, "prefill >= 70% of the matmul roofline") == "MET"  # 420 bar
    assert _status(lines, "prefill >= 2x transformers") == "MET"
    assert _status(lines, "32 concurrent decode >= 50% of the roofline") == "MISSED"  # 200 bar


def test_the_bandwidth_target_follows_the_share_measured_around_the_decode_run():
    rows = [
        Row("batch-1 decode", "sglite bfloat16 q4_k+q6_k a8", 19.0, "tok/s"),
        Row(BANDWIDTH_SHARE, "sglite bfloat16 q4_k+q6_k a8", 70.0, "%"),
    ]
    lines = targets(rows, MACHINE)
    assert _status(lines, "batch-1 decode >= 85% of the bandwidth limit") == "MISSED"


def test_a_target_without_its_peer_says_it_was_not_measured():
    rows = [Row("batch-1 decode", "sglite float32 q4_1 a8", 50.0, "tok/s")]
    lines = targets(rows, MACHINE)
    assert "not measured" in [x for x in lines if "1.1x llama.cpp" in x][0]


@pytest.mark.parametrize(
    ("content", "name"),
    [
        ("native (GGML_NATIVE=ON)\n", "native build"),
        ("native crashed; -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF\n", "build without AMX"),
        (None, "build"),
    ],
)
def test_the_llama_cpp_build_is_named_from_the_build_scripts_record(tmp_path, content, name):
    binary = tmp_path / "llama-bench"
    binary.write_text("")
    if content is not None:
        (tmp_path / "BUILD").write_text(content)
    assert llama_build(str(binary)) == name


# ---------------------------------------------------------------------------- crashed peers
@pytest.fixture(autouse=True)
def _logs_in_tmp(tmp_path, monkeypatch):
    """The crash logs the benchmarks keep (and name) land in the test's folder."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _segfaulting_llama(folder) -> str:
    """llama-server and llama-bench that segfault (real processes), with the build script's
    record of the configuration."""
    folder.mkdir()
    for name in ("llama-server", "llama-bench"):
        (folder / name).write_text("#!/bin/sh\nkill -SEGV $$\n")
        (folder / name).chmod(0o755)
    (folder / "BUILD").write_text("native crashed; -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF\n")
    return str(folder / "llama-server")


def test_bench_engine_reports_a_crashed_llama_cpp_and_its_fallback(tmp_path):
    import argparse

    from benchmarks.engine_peers import bench_llama_cpp
    from benchmarks.engine_report import report

    args = argparse.Namespace(
        llama_server=_segfaulting_llama(tmp_path / "bin"),
        model=default_model_path(),
        threads=1,
        quick=True,
    )
    rows: list[Row] = []
    notes = bench_llama_cpp(args, rows)
    machine = {"decode_limit": 10.0, "prefill_roofline": 10.0, "batch32_roofline": 10.0}
    text = report(rows, machine, args, notes)
    assert "llama.cpp: build without AMX: native crashed; -DGGML_NATIVE=OFF" in text
    table = [line for line in text.splitlines() if line.startswith("| batch-1 decode |")]
    # The default configuration's crash and the --repack 0 fallback's, each a row of its own.
    assert len(table) == 2 and all("crashed (exit -11 SIGSEGV, log: " in x for x in table)
    assert "fallback: --repack 0, the default crashed" in table[1]
    target = next(x for x in text.splitlines() if "1.1x llama.cpp" in x)
    assert "not measured" in target and "exit -11 SIGSEGV" in target
    assert any("measured again with --repack 0" in n for n in notes)


def test_run_all_reports_a_crashed_llama_cpp_in_its_table_and_summary(tmp_path, capsys):
    from benchmarks.run_all import main

    server = _segfaulting_llama(tmp_path / "bin")
    argv = ["--systems", "llama.cpp", "--workloads", "mmlu", "--num-requests", "1"]
    assert main([*argv, "--no-write", "--llama-server", server]) == []
    out = capsys.readouterr().out
    assert "**Incomplete run**: llama.cpp crashed at start-up (exit -11 SIGSEGV" in out
    row = next(line for line in out.splitlines() if line.startswith("| mmlu | llama.cpp |"))
    assert "crashed at start-up (exit -11 SIGSEGV, log: " in row
    status = next(line for line in out.splitlines() if line.startswith("- llama.cpp ["))
    assert "build without AMX: native crashed" in status and "exit -11 SIGSEGV" in status


def test_run_all_reports_a_llama_cpp_that_crashes_mid_run(tmp_path, capsys):
    from benchmarks.run_all import main
    from tests.test_bench_runner import SEGFAULT_ON_REQUEST, _fake_llama

    server = _fake_llama(tmp_path / "midrun", SEGFAULT_ON_REQUEST)
    argv = ["--systems", "llama.cpp", "--workloads", "mmlu", "--num-requests", "1"]
    assert main([*argv, "--no-write", "--llama-server", server]) == []
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| mmlu | llama.cpp |"))
    assert "crashed mid-run (exit -11 SIGSEGV, log: " in row
