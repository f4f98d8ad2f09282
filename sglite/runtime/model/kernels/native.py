"""Build and load the CPU kernels in `cpu_kernels.c` (gcc, once per source and CPU, cached).

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
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_INT = ctypes.c_int
_SIGNATURES: dict[str, list] = {
    "add_rms_norm": [_INT, _P, _P, _P, _P, _I, _I, _F, _INT],
    "silu_mul": [_INT, _P, _P, _I, _I, _INT],
    "rope_store_kv": [_INT, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _INT],
    "paged_decode_attention": [
        _INT,
        _P,
        _I,
        _P,
        _P,
        _P,
        _I,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
        _F,
        _I,
        _INT,
    ],  # fmt: skip
}

# Constants the attention kernel was built with (its query-group and head-size limits).
_LIMITS = ("attention_max_group", "attention_max_head_dim", "attention_vec_width")


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cache_dir() -> Path:
    root = os.environ.get("SGLITE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sglite" / "kernels"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_fingerprint()]).encode()
    ).hexdigest()[:20]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


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
                    for name, argtypes in _SIGNATURES.items():
                        fn = getattr(lib, name)
                        fn.argtypes = argtypes
                        fn.restype = None
                    for name in _LIMITS:
                        getattr(lib, name).restype = ctypes.c_int64
                except Exception as exc:  # any build or load failure falls back to torch
                    logger.warning("native CPU kernels unavailable (%s): using PyTorch", exc)
                    lib = None
        _state["lib"] = lib
        return lib
