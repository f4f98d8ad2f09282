"""Build and load the CPU kernels in this folder's C files (gcc, once per source and CPU, cached).

The library is compiled with `-march=native` on first use into a cache folder
(`$SGLITE_KERNEL_CACHE`, default `~/.cache/sglite/kernels`), keyed by a hash of the source, the
flags, the compiler and the CPU, and loaded with ctypes (calls release the GIL). Several processes
may build at once: each writes a private file and renames it into place. When no compiler is
found or the build fails, `load()` returns None and callers use their PyTorch formulation;
`SGLITE_NATIVE_KERNELS=0` forces that.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sglite.runtime.model.kernels.abi import ABI

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [
    _HERE / "elementwise.c",
    _HERE / "attention.c",
    _HERE / "extend_attention.c",
    _HERE / "quant_gemv.c",
    _HERE / "gguf_blocks.c",
    _HERE / "gguf_a8.c",
    _HERE / "gguf_a8_gemm.c",
    _HERE / "gguf_a8_k4_block.c",
    _HERE / "gguf_tiles.c",
    _HERE / "gguf_quads.c",
    _HERE / "a8_rounding.c",
    _HERE / "gguf_amx.c",
    _HERE / "bf16_probe.c",
    _HERE / "cpu_kind.c",
    _HERE / "decode_step.c",
    _HERE / "panel_gemm.c",
    _HERE / "quant_gemm.c",
    _HERE / "threadpool.c",
    _HERE / "build_info.c",
]
HEADERS = [
    _HERE / "kernels.h",
    _HERE / "common.h",
    _HERE / "vec.h",
    _HERE / "threadpool.h",
    _HERE / "gguf_bits.h",
    _HERE / "a8_rounding.h",
    _HERE / "gguf_a8_k4_block.h",
    _HERE / "gguf_a8_kquant_rows.h",
    _HERE / "gguf_a8_k4_lanes.h",
    _HERE / "gguf_a8_b32_rows.h",
    _HERE / "gguf_a8_gemm_decode.h",
    _HERE / "gguf_a8_tiled_rows.h",
    _HERE / "gguf_a8_gemm_pairs.h",
    _HERE / "gguf_float_rows.h",
    _HERE / "quant_gemv_int4_dot.h",
    _HERE / "gguf_bf16_decode.h",
    _HERE / "gguf_tile_products.h",
    _HERE / "attention_blocks.h",
    _HERE / "transpose16.h",
    _HERE / "gguf_tiles.h",
    _HERE / "gguf_quads.h",
]
# -fno-math-errno lets lrintf/fmaxf/sqrtf compile to single instructions (errno is never read);
# -fopenmp links libgomp, which torch has loaded already (one OpenMP runtime in the process).
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",
    "-pthread",
    "-shared",
    "-fPIC",
    "-std=gnu11",
]

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}

# /proc/cpuinfo lines naming the CPU and its features: x86 ("model name", "flags") and ARM
# ("CPU implementer", "CPU part", "Features").
_CPU_LINES = ("model name", "flags", "CPU implementer", "CPU part", "Features")


def _cpu_fingerprint() -> str:
    """The machine and its CPU features (the library is built with -march=native)."""
    lines = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            seen: set[str] = set()
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in _CPU_LINES and key not in seen:  # the first core's
                    seen.add(key)
                    lines.append(line)
    except OSError:
        pass
    return "\n".join(lines)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cache_dir() -> Path:
    root = os.environ.get("SGLITE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sglite" / "kernels"


def _compiler_identity(cc: str) -> str:
    """What names the compiler in the cache key: its resolved file's path, size and modification
    time (an upgrade changes them), read without running it: a process that has imported torch
    forks slowly, and this runs on every start. `--version` only for a compiler not on PATH."""
    path = shutil.which(cc)
    if path is None:
        return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    real = os.path.realpath(path)
    stat = os.stat(real)
    return f"{real} {stat.st_size} {stat.st_mtime_ns}"


def _build(cc: str) -> Path:
    version = _compiler_identity(cc)
    texts = [p.read_text() for p in SOURCES + HEADERS]
    key = hashlib.sha256(
        "\0".join([*texts, " ".join(FLAGS), version, _cpu_fingerprint()]).encode()
    ).hexdigest()[:20]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            _compile_and_link(cc, objects, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile_and_link(cc: str, objects: str, out: str) -> None:
    """Compile every source to an object file, as many at once as there are cores (the first
    start of a machine waits for this), then link them into `out`."""
    compile_flags = [f for f in FLAGS if f != "-shared"]
    jobs = []
    for source in SOURCES:
        obj = os.path.join(objects, source.stem + ".o")
        cmd = [cc, *compile_flags, "-c", "-o", obj, str(source)]
        jobs.append((cmd, obj))
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(_run, [cmd for cmd, _ in jobs]))
    for done in results:
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(done.args)} failed:\n{done.stderr[-2000:]}")
    link = _run([cc, *FLAGS, "-o", out, *(obj for _, obj in jobs), "-lm"])
    if link.returncode != 0:
        raise RuntimeError(f"{' '.join(link.args)} failed:\n{link.stderr[-2000:]}")


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None when disabled or unbuildable (logged)."""
    if "lib" in _state:  # the hot path: no lock once decided
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib = None
        if os.environ.get("SGLITE_NATIVE_KERNELS", "1") != "0":
            cc = _compiler()
            if cc is None:
                logger.warning("no C compiler found: using the slower PyTorch kernels")
            else:
                try:
                    lib = ctypes.CDLL(str(_build(cc)))
                    ABI.declare(lib)
                except Exception as exc:  # any build or load failure falls back to torch
                    logger.warning("native CPU kernels unavailable (%s): using PyTorch", exc)
                    lib = None
        _state["lib"] = lib
        return lib


DTYPE_CODES = {
    torch.float32: ABI.constants["DTYPE_FLOAT32"],
    torch.bfloat16: ABI.constants["DTYPE_BFLOAT16"],
}


def lib_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The native library if every tensor can go through it, else None."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return None
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu":
            return None
    return load()


def isa() -> list[str]:
    """The instruction-set extensions the loaded library was built with (e.g. ["avx2_fma",
    "f16c"]; empty for the portable C path or without the library)."""
    lib = load()
    if lib is None:
        return []
    bits = int(lib.kernel_isa())
    names = [name for name in ABI.constants if name.startswith("ISA_")]
    return [name[4:].lower() for name in names if bits & ABI.constants[name]]
