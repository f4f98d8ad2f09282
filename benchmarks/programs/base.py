"""What a benchmark workload is: an sglite program, its synthetic data, and a shape check.

Every workload of the suite (`benchmarks/programs/<name>.py`) exposes one `WORKLOAD`. Runners
(`benchmarks/runners/`) execute `workload.program.run_batch(workload.make_args(n, seed))` on
some backend and hand each finished state to `workload.check`. The program logic is the same
for every system: systems differ only in the backend the interpreter calls.

Invariants:
- `make_args` is deterministic in (num_requests, seed) and needs no download; it returns
  exactly `num_requests` argument dicts.
- `check(state, args)` raises AssertionError naming the variable when the program's variables
  are missing or have the wrong shape (it never judges answer quality: the model is tiny).
- Generation is greedy and bounded (`max_tokens` small enough for a 2-core CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """One benchmark workload of the paper's table (see the module docstring)."""

    name: str  # short id used on the command line and in tables, e.g. "mmlu"
    description: str  # one line for the report
    program: Any  # an @sgl.function
    make_args: Callable[[int, int], list[dict[str, Any]]]  # (num_requests, seed) -> kwargs
    check: Callable[[Any, dict[str, Any]], None]  # (finished ProgramState, its kwargs)
    shared_prefix: bool  # whether requests share prompt prefixes (the cache should pay)
    default_num_requests: int  # full-size run
    quick_num_requests: int  # `--quick` run: a smoke run of the whole suite
