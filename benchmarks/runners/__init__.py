"""Runners: the systems the workloads of `benchmarks/programs/` are measured on.

One module per system (`sglite_engine.py` with its ablations, `sglite_http.py`, `hf.py`,
`llama_cpp.py`), all sharing `common.py` (the `System` lifecycle, the timed program harness and
the `ResultRow`). `make_system(name, ...)` builds one by its table name.
"""

from __future__ import annotations

from benchmarks.runners.common import ResultRow, System
from benchmarks.runners.sglite_engine import ENGINE_VARIANTS

# Table order: the system under test, its HTTP front end, the two peers, then the ablations.
ALL_SYSTEMS = [
    "sglite", "sglite-http", "transformers", "llama.cpp",
    "sglite-no-cache", "sglite-fcfs", "sglite-no-precache", "sglite-no-jf",
]  # fmt: skip
QUICK_SYSTEMS = ["sglite", "transformers", "llama.cpp"]


def make_system(
    name: str,
    threads: int | None = None,
    llama_server: str | None = None,
    hf_dtype: str = "auto",
) -> System:
    """The system called `name` (not started). `llama_server` is the binary for "llama.cpp"."""
    if name in ENGINE_VARIANTS:
        from benchmarks.runners.sglite_engine import EngineSystem

        return EngineSystem(name, threads=threads)
    if name == "sglite-http":
        from benchmarks.runners.sglite_http import HTTPSystem

        return HTTPSystem(threads=threads)
    if name == "transformers":
        from benchmarks.runners.hf import HFSystem

        return HFSystem(dtype=hf_dtype, threads=threads)
    if name == "llama.cpp":
        from benchmarks.runners.llama_cpp import LlamaServerSystem

        if llama_server is None:
            raise ValueError("the llama.cpp system needs a llama-server binary")
        return LlamaServerSystem(llama_server, threads=threads)
    raise KeyError(f"unknown system {name!r}; valid: {', '.join(ALL_SYSTEMS)}")


__all__ = ["ALL_SYSTEMS", "QUICK_SYSTEMS", "ResultRow", "System", "make_system"]
