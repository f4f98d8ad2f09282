"""bench_footprint's helpers: memory summed over a process tree, a start reported as crashed or
exceeded (RSS guard), and the synthetic GGUF writer on a tiny config (types, shapes, copied and
padded tokenizer, finite positive scales)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from benchmarks.common import free_port
from benchmarks.footprint_memory import kill_tree, process_tree, tree_memory
from benchmarks.footprint_servers import ServerCommand, measure_start
from benchmarks.synthetic_gguf import QT, SyntheticConfig, tensor_plan, write_synthetic

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

MB = 1 << 20
# A child that starts a grandchild; each touches 64 MB and sleeps.
HOLD = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(60)"
TREE = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {HOLD!r}]); exec({HOLD!r})"


def _vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_tree_memory_sums_child_and_grandchild():
    proc = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        # held: both processes past 64 MB and done touching it (their RSS as at the last poll;
        # a process still touching its pages grows between two reads)
        deadline, last = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            tree = process_tree(proc.pid)
            rss = [_vm_rss(p) for p in tree] if len(tree) == 2 else None
            if rss is not None and min(rss) > 64 * MB and rss == last:
                break
            last = rss
            time.sleep(0.05)
        else:
            pytest.fail(f"the child tree never held its memory: {process_tree(proc.pid)}")
        assert tree[0] == proc.pid
        mem = tree_memory(proc.pid)
        assert mem.processes == 2
        assert mem.rss >= 2 * 64 * MB
        assert abs(mem.rss - sum(_vm_rss(p) for p in tree)) < 8 * MB  # the same processes
        assert 64 * MB < mem.pss <= mem.rss + 8 * MB
        assert tree_memory(proc.pid, pss=False).pss == 0
    finally:
        kill_tree(proc.pid, 9)
        proc.wait()
    assert tree_memory(proc.pid).processes == 0  # gone: nothing counted, no error


def _tiny_tokenizer_source(path: Path) -> None:
    """A GGUF holding only tokenizer metadata (5 tokens), like a real file's."""
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["a", "b", "ab", "<|im_end|>", "<|endoftext|>"])
    w.add_token_types([1, 1, 1, 3, 3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def test_synthetic_writer_tiny_config(tmp_path):
    cfg = SyntheticConfig(
        layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab_rows=8
    )
    source = tmp_path / "tok.gguf"
    _tiny_tokenizer_source(source)
    out = write_synthetic(tmp_path / "tiny.gguf", cfg, source, seed=1)
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place

    r = gguf.GGUFReader(out)
    assert r.fields["general.architecture"].contents() == "qwen2"
    assert r.fields["qwen2.block_count"].contents() == 2
    assert r.fields["qwen2.attention.head_count_kv"].contents() == 2
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert tokens == ["a", "b", "ab", "<|im_end|>", "<|endoftext|>", "[PAD5]", "[PAD6]", "[PAD7]"]
    assert r.fields["tokenizer.ggml.token_type"].contents()[-3:] == [5, 5, 5]  # UNUSED
    assert r.fields["tokenizer.ggml.merges"].contents() == ["a b"]
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 3
    assert r.fields["tokenizer.chat_template"].contents() == "{{ messages }}"

    plan = tensor_plan(cfg)
    assert [t.name for t in r.tensors] == [p.name for p in plan]
    for t, p in zip(r.tensors, plan):
        assert t.tensor_type == p.qtype, t.name
        assert tuple(int(d) for d in reversed(t.shape)) == p.shape, t.name  # ggml order
        assert t.n_bytes == p.nbytes
        if p.qtype == QT.F32:
            assert np.isfinite(t.data).all()
            continue
        blocks = t.data.reshape(-1, gguf.GGML_QUANT_SIZES[p.qtype][1])
        cols = [0, 2] if p.qtype == QT.Q4_K else [blocks.shape[1] - 2]  # d, dmin / d
        for c in cols:
            scales = blocks[:, c : c + 2].copy().view(np.float16).astype(np.float32)
            assert np.isfinite(scales).all() and (scales > 0).all() and (scales < 1e-2).all()
        weights = dequantize(t.data, t.tensor_type)
        assert weights.shape == p.shape and np.isfinite(weights).all()
        assert 0 < np.abs(weights).max() < 1.0
    assert {t.tensor_type for t in r.tensors} == {QT.F32, QT.Q4_K, QT.Q6_K}
    assert r.get_tensor(0).name == "token_embd.weight"
    assert r.tensors[-1].name == "output.weight" and r.tensors[-1].tensor_type == QT.Q6_K


def _fake_server(code: str) -> ServerCommand:
    return ServerCommand("fake", [sys.executable, "-c", code], free_port(), "/x", {})


def test_measure_start_reports_crashed_and_exceeded():
    args = argparse.Namespace(max_rss_gb=0.1, min_available_gb=0.0, timeout=30)
    crashed = measure_start(_fake_server("import sys; sys.exit(3)"), "m", "first", args)
    assert crashed.status == "crashed" and "exit code 3" in crashed.detail
    hog = "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(60)"
    exceeded = measure_start(_fake_server(hog), "m", "first", args)
    assert exceeded.status == "exceeded" and "RSS" in exceeded.detail
    assert exceeded.peak_rss > 0.1e9 and exceeded.ready_s is None
    for s in (crashed, exceeded):  # the failed server's log is kept and named
        log = s.detail.rsplit("log ", 1)[1]
        os.unlink(log)
