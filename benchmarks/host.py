"""The host line every benchmark prints beside its figures: CPU model, cores, SIMD/AMX flags."""

from __future__ import annotations

import os
import subprocess

FLAGS_OF_NOTE = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_line() -> str:
    """lscpu's model name, core count and the SIMD/AMX flags that matter here."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
        model = fields.get("Model name", "?").strip()
        flags = set(fields.get("Flags", "").split())
    except (OSError, subprocess.CalledProcessError):
        model, flags = "? (no lscpu)", set()
    have = [f for f in FLAGS_OF_NOTE if f in flags] or ["none of " + "/".join(FLAGS_OF_NOTE)]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(have)}"
