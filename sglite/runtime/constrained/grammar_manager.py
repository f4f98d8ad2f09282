"""Compiles constraints off the scheduler's critical path and caches the compiled grammars.

`submit` returns at once with a `GrammarTicket`; compilation runs on a small thread pool
(llguidance and xgrammar release the GIL while compiling), so a long compile never stalls the
forward passes of other requests. Compiled templates are cached by `(kind, text)` (LRU, also
remembering failures so a repeated bad grammar fails fast); each request gets its own copy.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglite.runtime.constrained.base import Constraint, GrammarBackend, GrammarError, GrammarMatcher
from sglite.runtime.server_args_checks import GRAMMAR_BACKENDS

if TYPE_CHECKING:
    from sglite.runtime.tokenizer import Tokenizer


def create_backend(
    name: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]
) -> GrammarBackend:
    """The backend called `name` for this tokenizer; ValueError naming what is missing."""
    if name == "llguidance":
        from sglite.runtime.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        try:
            from sglite.runtime.constrained.xgrammar_backend import XGrammarBackend
        except ImportError as exc:
            raise ValueError(
                f"grammar backend 'xgrammar' is not installed ({exc}); "
                "install it with: bash scripts/install_xgrammar.sh "
                "(pip install 'sglite[xgrammar]' works too but also pulls triton)"
            ) from None
        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {name!r}")


def validate_constraint(kind: str, text: str, backend: str = "llguidance") -> None:
    """Raise GrammarError (a ValueError) with the parser's message if the constraint is invalid.

    Runs without a tokenizer, on the client side, so bad input is refused before queueing.
    """
    constraint = Constraint(kind, text)
    if backend == "xgrammar":
        from sglite.runtime.constrained.xgrammar_backend import validate_constraint as check
    else:
        from sglite.runtime.constrained.llguidance_backend import validate_constraint as check
    try:
        check(constraint)
    except GrammarError as exc:
        exc.kind = exc.kind or kind
        raise


@dataclass
class GrammarTicket:
    """A pending compilation for one request."""

    constraint: Constraint
    future: Future
    submitted: float = field(default_factory=time.monotonic)

    def result(self, timeout_s: float) -> GrammarMatcher | GrammarError | None:
        """The request's own matcher, the error, or None while still compiling.

        Past `timeout_s` an unfinished compile becomes a GrammarError (the worker thread is
        left to finish; its result is cached for next time).
        """
        if not self.future.done():
            if time.monotonic() - self.submitted > timeout_s:
                return GrammarError(
                    f"{self.constraint.kind}: grammar compilation took longer than {timeout_s:g} s"
                )
            return None
        exc = self.future.exception()
        if exc is not None:
            if isinstance(exc, GrammarError):
                return exc
            return GrammarError(f"{self.constraint.kind}: {type(exc).__name__}: {exc}")
        return self.future.result().copy()


class GrammarManager:
    """Per-scheduler grammar compilation with a bounded cache of compiled templates."""

    def __init__(self, backend: GrammarBackend, max_cached: int = 512, workers: int = 2) -> None:
        self.backend = backend
        self.max_cached = max_cached
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self.compiled = 0
        self.cache_hits = 0

    def submit(self, constraint: Constraint) -> GrammarTicket:
        """Start (or reuse) the compilation of `constraint`."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            self.cache_hits += 1
        else:
            future = self._pool.submit(self.backend.compile, constraint)
            self.compiled += 1
            self._cache[constraint] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return GrammarTicket(constraint, future)

    def shutdown(self) -> None:
        """Stop the worker threads (pending compiles are abandoned)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
