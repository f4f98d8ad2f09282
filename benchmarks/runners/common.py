"""What every runner shares: the result row, the timed program harness, the `System` lifecycle.

A `System` is one thing a user could run the workloads on (sglite's Engine, its HTTP server,
transformers, llama.cpp's server, an sglite ablation). `start()` loads the model once, `run()`
executes one workload on a cold cache and returns a `ResultRow`, `stop()` frees everything, so
`benchmarks/run_all.py` can keep at most one model loaded at a time.

Measurement, the same for every system:
- programs run through sglite's interpreter, as `run_batch` runs them (the traced constant
  prefix is pre-cached first, then every program on its own thread), but each program's start
  and end are timed for the latency percentile; the wall time covers pre-caching and all
  programs;
- output tokens are the generated texts re-tokenized with the default model's tokenizer (one
  rule for all systems, whatever they report);
- the cache hit rate is the difference of the runtime's own counters (cached / queried prompt
  tokens) over the run, None where the system has none; the ideal hit rate comes from the calls
  the system made (`benchmarks/ideal_cache.py`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from benchmarks.common import percentile
from benchmarks.ideal_cache import CallLog
from benchmarks.programs.base import Workload

# Concurrency of the program harness: run_batch's "auto" (every program at once, up to 96).
MAX_PROGRAM_THREADS = 96


@dataclass
class ResultRow:
    """One workload on one system."""

    system: str
    workload: str
    programs: int
    failed: int
    wall_s: float
    programs_per_s: float
    output_tokens: int
    output_tok_per_s: float
    p50_latency_s: float
    cache_hit_rate: float | None  # from the runtime's own counters; None: not reported
    ideal_hit_rate: float
    shared_prefix: bool
    errors: list[str] = field(default_factory=list)  # a few failure messages

    @property
    def ok(self) -> int:
        """Programs that finished and passed the workload's check."""
        return self.programs - self.failed


@dataclass
class Timed:
    """A finished program state with its own wall time."""

    state: Any
    latency_s: float


@lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """The default model's tokenizer (sglite's loader), for counting tokens the same way."""
    from sglite.runtime.model.loader import load_tokenizer

    return load_tokenizer(None)


def default_threads() -> int:
    """Threads every system gets: all cores."""
    return os.cpu_count() or 1


def run_programs(
    program: Any, backend: Any, batch: list[dict[str, Any]], temperature: float = 0.0
) -> tuple[list[Timed], float]:
    """Run `program` once per argument dict like `run_batch` does, timing each program.

    Returns the timed states in input order and the wall time of the whole batch (pre-caching
    included). Programs that fail keep their error in `state.error()`.
    """
    from sglite.lang.global_config import global_config
    from sglite.lang.interpreter import cache_program, run_program
    from sglite.lang.sampling_params import SglSamplingParams

    defaults = SglSamplingParams(temperature=temperature)

    def one(arguments: dict[str, Any]) -> Timed:
        start = time.perf_counter()
        state = run_program(program, backend, (), arguments, defaults, False, True, True)
        return Timed(state, time.perf_counter() - start)

    start = time.perf_counter()
    if global_config.enable_precache_with_tracing and len(batch) > 1:
        cache_program(program, backend)
    threads = max(1, min(len(batch), MAX_PROGRAM_THREADS))
    with ThreadPoolExecutor(threads, thread_name_prefix="bench-program") as pool:
        timed = list(pool.map(one, batch))
    return timed, time.perf_counter() - start


def check_states(workload: Workload, timed: list[Timed], batch: list[dict[str, Any]]) -> list[str]:
    """Failure messages of the programs that raised or whose variables fail the check."""
    errors = []
    for t, arguments in zip(timed, batch):
        err = t.state.error()
        if err is None:
            try:
                workload.check(t.state, arguments)
            except Exception as exc:  # any check failure is a failed program, never a crash
                err = exc
        if err is not None:
            errors.append(f"{type(err).__name__}: {str(err)[:160]}")
    return errors


class System:
    """One system under test; subclasses set `backend` in `start()` and may report counters."""

    name = "system"
    description = ""

    def __init__(self) -> None:
        self.backend: Any = None
        self.notes: list[str] = []  # caveats for the report (e.g. unconstrained decoding)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Load the model (once for all workloads)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Free the model and any process."""

    def __enter__(self) -> System:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ hooks
    def flush(self) -> None:
        """Empty the system's prefix cache (a cold cache for every workload)."""

    def counters(self) -> tuple[int, int] | None:
        """Cumulative (cached, queried) prompt tokens from the runtime, or None."""
        return None

    def instrument(self, log: CallLog) -> None:
        """Record each model call into `log` from now on (until the next `instrument`)."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """One tiny program, so one-time costs do not land in the first workload."""
        import sglite as sgl

        @sgl.function
        def hello(s):
            s += "Say hello." + sgl.gen("x", max_tokens=4, temperature=0)

        self.instrument(CallLog())
        state = hello.run(backend=self.backend)
        state.sync()
        self.flush()

    # ------------------------------------------------------------------ one workload
    def run(self, workload: Workload, num_requests: int, seed: int = 0) -> ResultRow:
        """Run `workload` with `num_requests` programs on a cold cache."""
        batch = workload.make_args(num_requests, seed)
        self.flush()
        log = CallLog()
        self.instrument(log)
        before = self.counters()
        timed, wall = run_programs(workload.program, self.backend, batch)
        after = self.counters()
        errors = check_states(workload, timed, batch)
        hit = None
        if before is not None and after is not None:
            queried = after[1] - before[1]
            hit = (after[0] - before[0]) / queried if queried > 0 else 0.0
        tok = default_tokenizer()
        out_tokens = log.output_tokens(tok.encode)
        return ResultRow(
            system=self.name,
            workload=workload.name,
            programs=len(batch),
            failed=len(errors),
            wall_s=wall,
            programs_per_s=len(batch) / wall,
            output_tokens=out_tokens,
            output_tok_per_s=out_tokens / wall,
            p50_latency_s=percentile([t.latency_s for t in timed], 50),
            cache_hit_rate=hit,
            ideal_hit_rate=log.ideal_hit_rate(tok.encode),
            shared_prefix=workload.shared_prefix,
            errors=errors[:3],
        )
