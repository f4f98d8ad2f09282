"""sglite in-process: the Engine backend, and the ablations that switch one idea off each.

| system | what changes |
|---|---|
| `sglite` | nothing: radix cache, cache-aware `lpm` scheduling, pre-caching, jump-forward |
| `sglite-no-cache` | `disable_radix_cache=True`: every request prefills its whole prompt |
| `sglite-fcfs` | `schedule_policy="fcfs"` instead of the cache-aware `lpm` |
| `sglite-no-precache` | the interpreter's prefix pre-caching off (see below) |
| `sglite-no-jf` | `disable_jump_forward=True`: constrained outputs decoded token by token |

`sglite-no-precache` turns off both fills the interpreter sends before generating: the traced
constant prefix before a batch (`global_config.enable_precache_with_tracing`) and the prefill of
the fork point before the branches start (the backend's `commit_lazy_operations`).

Each system is a fresh Engine (started in `start()`, shut down in `stop()`), the cache flushed
before every workload; hit rates come from `get_server_info()`'s `cached_prompt_tokens` /
`queried_prompt_tokens`.
"""

from __future__ import annotations

from typing import Any

from benchmarks.ideal_cache import CallLog, record_native_backend
from benchmarks.runners.common import ResultRow, System, default_threads

# name -> (Engine keywords, pre-caching on, one line for the report)
ENGINE_VARIANTS: dict[str, tuple[dict[str, Any], bool, str]] = {
    "sglite": ({}, True, "sglite Engine backend (in-process), all optimisations"),
    "sglite-no-cache": (
        {"disable_radix_cache": True}, True, "ablation: radix cache off",
    ),
    "sglite-fcfs": ({"schedule_policy": "fcfs"}, True, "ablation: fcfs instead of lpm"),
    "sglite-no-precache": ({}, False, "ablation: no prefix pre-caching (traced prefix, fork)"),
    "sglite-no-jf": ({"disable_jump_forward": True}, True, "ablation: no jump-forward"),
}  # fmt: skip


class NativeSystem(System):
    """Shared parts of the Engine and HTTP systems (both speak the native protocol)."""

    precache = True

    def flush(self) -> None:
        self.backend.flush_cache()

    def counters(self) -> tuple[int, int]:
        info = self.backend.get_server_info()
        return int(info["cached_prompt_tokens"]), int(info["queried_prompt_tokens"])

    def instrument(self, log: CallLog) -> None:
        # Re-wrap the original transport each time, so wrappers never stack up.
        b = self.backend
        if not hasattr(b, "_bench_transport"):
            b._bench_transport = b._request
        b._request = b._bench_transport
        record_native_backend(self.backend, log, self._decode)
        if not self.precache:
            self.backend.commit_lazy_operations = lambda s: None

    def _decode(self, ids: list[int]) -> str:
        from benchmarks.runners.common import default_tokenizer

        return default_tokenizer().decode(ids)

    def run(self, workload: Any, num_requests: int, seed: int = 0) -> ResultRow:
        from sglite.lang.global_config import global_config

        saved = global_config.enable_precache_with_tracing
        global_config.enable_precache_with_tracing = saved and self.precache
        try:
            return super().run(workload, num_requests, seed)
        finally:
            global_config.enable_precache_with_tracing = saved


class EngineSystem(NativeSystem):
    """`sglite.Engine` in this process (its model in a child process), one variant."""

    def __init__(
        self,
        variant: str = "sglite",
        threads: int | None = None,
        engine: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        """`engine`: run on this already started Engine (not shut down by `stop()`) instead of
        starting one; its options are then the engine's own."""
        super().__init__()
        kwargs, precache, description = ENGINE_VARIANTS[variant]
        self.name = variant
        self.description = description
        self.precache = precache
        self.engine_kwargs = {"num_threads": threads or default_threads(), **kwargs}
        self.engine_kwargs.update(engine_kwargs)
        self.engine: Any = engine
        self._owns_engine = engine is None
        self.resolved_dtype = ""

    def start(self) -> None:
        import sglite
        from sglite.lang.backend.engine_backend import EngineBackend

        if self._owns_engine:
            self.engine = sglite.Engine(log_level="error", **self.engine_kwargs)
        self.backend = EngineBackend(self.engine)
        self.resolved_dtype = str(self.engine.get_server_info().get("dtype", ""))

    def stop(self) -> None:
        if self.engine is not None and self._owns_engine:
            self.engine.shutdown()
            self.engine = None
        self.backend = None
