"""The machine's limits for one model, as bench_engine sets its targets against them: the model's
GFLOP and weight bytes per token, torch matmul GFLOP/s and memory read GB/s, and the prefill,
batch-1 and 32-way decode rooflines that follow."""

from __future__ import annotations

import time

import torch

from benchmarks.engine_rows import Row
from benchmarks.engine_workloads import best_time
from sglite.runtime.model import kernels


def gflop_per_token(model_path: str) -> float:
    """2 x the parameters of the model's layers (attention and MLP projections, norms)."""
    from sglite.runtime.model.gguf_index import open_gguf

    params = sum(
        int(torch.tensor(t.shape).prod())
        for t in open_gguf(model_path).tensors
        if t.name.startswith("blk.")
    )
    return 2 * params / 1e9


def weight_bytes_per_token(model_path: str) -> int:
    """Bytes of weights one batch-1 decode step reads: every layer's tensors and the output
    projection (the tied embedding where the file has no `output.weight`), as the file stores
    them; the embedding lookup reads one row."""
    from sglite.runtime.model.gguf_index import open_gguf

    tensors = {t.name: t.n_bytes for t in open_gguf(model_path).tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight", 0))
    return sum(n for name, n in tensors.items() if name.startswith("blk.")) + head


def bandwidth_probe() -> torch.Tensor:
    """A tensor beyond any cache (512 MB) for `read_gbs`."""
    return torch.ones(1 << 27, dtype=torch.float32)


def read_gbs(probe: torch.Tensor, repeats: int = 2) -> float:
    """GB/s of summing `probe`: the memory read rate at this moment."""
    return probe.numel() * probe.element_size() / best_time(lambda: probe.sum(), repeats) / 1e9


def bench_machine(rows: list[Row], gflop: float, weight_bytes: int) -> dict[str, float]:
    """Matmul GFLOP/s and memory bandwidth with torch, on this run's threads, and the limits
    they set: prefill (matmul / FLOP per token), batch-1 decode (bandwidth / weight bytes per
    token) and 32 concurrent decodes (the lower of 32 x the decode limit and the prefill one)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        # 1024^3 first: where bf16 is emulated, a 2048^3 product is too slow to repeat.
        size = 1024
        a = torch.randn(size, size, dtype=dtype)
        start = time.perf_counter()
        a @ a
        if time.perf_counter() - start < 0.05:
            size = 2048
            a = torch.randn(size, size, dtype=dtype)
            a @ a
        t = best_time(lambda a=a: a @ a, 5 if size == 2048 else 2)
        name = str(dtype).replace("torch.", "")
        out[name] = 2 * size**3 / t / 1e9
        rows.append(Row(f"matmul {size}^3 {name}", "torch", out[name], "GFLOP/s"))
    out["read_gbs"] = read_gbs(bandwidth_probe(), 5)
    rows.append(Row("memory read", "torch", out["read_gbs"], "GB/s"))
    # The prefill target is set against the bf16 matmul; on CPUs without native bf16 (where
    # PyTorch emulates it at a fraction of float32's rate and sglite runs float32) the faster
    # of the two is the machine's limit.
    best = max(out["bfloat16"], out["float32"])
    out["prefill_roofline"] = best / gflop
    rows.append(Row("prefill roofline (best matmul)", "torch", out["prefill_roofline"], "tok/s"))
    out["decode_limit"] = out["read_gbs"] * 1e9 / weight_bytes
    rows.append(Row("batch-1 decode limit (bandwidth)", "torch", out["decode_limit"], "tok/s"))
    out["batch32_roofline"] = min(32 * out["decode_limit"], out["prefill_roofline"])
    rows.append(Row("32 concurrent decode roofline", "torch", out["batch32_roofline"], "tok/s"))
    # Whether sglite's bf16 products take AVX512-BF16 dot products here (kernels/bf16_probe.c).
    taken = "bf16 products" if kernels.bf16_matmul_pays() else "float32 products"
    rate = kernels.bf16_dot_speed_percent()
    rows.append(Row(f"vdpbf16ps rate (% of an FMA's; sglite: {taken})", "probe", rate, "%"))
    return out
