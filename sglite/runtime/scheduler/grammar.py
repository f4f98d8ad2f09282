"""The scheduler's side of constrained decoding: waiting for grammars, and vocabulary masks.

Requests whose grammar is still compiling wait in `GrammarQueue` (compiling runs on worker
threads, so it never stalls other requests' forward passes). Each sampling step masks the rows
of constrained requests in one vectorised op. Jump-forward, which drafts the tokens a grammar
forces, lives in `drafts.py`.
"""

from __future__ import annotations

import torch

from sglite.runtime.constrained import Constraint, GrammarError, GrammarManager
from sglite.runtime.constrained.bitmask import allocate_bitmask, apply_bitmask
from sglite.runtime.scheduler.request import Req


class GrammarQueue:
    """Requests whose grammar is still compiling; `poll` releases them when it is ready."""

    def __init__(self, manager: GrammarManager, timeout_s: float) -> None:
        self.manager = manager
        self.timeout_s = timeout_s
        self.pending: list[Req] = []

    def add(self, req: Req, constraint: tuple[str, str]) -> None:
        """Start compiling `req`'s constraint; raises GrammarError for an unknown kind."""
        req.grammar_ticket = self.manager.submit(Constraint(*constraint))
        self.pending.append(req)

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests now holding their matcher, (request, error message) for failed ones)."""
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        still: list[Req] = []
        for req in self.pending:
            assert req.grammar_ticket is not None
            result = req.grammar_ticket.result(self.timeout_s)
            if result is None:
                still.append(req)
            elif isinstance(result, GrammarError):
                failed.append((req, str(result)))
            else:
                req.grammar, req.grammar_ticket = result, None
                ready.append(req)
        self.pending = still
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        """Take a request out (aborted while compiling)."""
        for req in self.pending:
            if req.rid == rid:
                self.pending.remove(req)
                return req
        return None


def apply_grammar_masks(
    reqs: list[Req], logits: torch.Tensor, vocab_size: int
) -> dict[int, Exception]:
    """Mask, in place, each constrained request's row of `logits` (row i belongs to reqs[i]).

    Returns {row: exception} for requests whose grammar failed to fill its mask: their rows stay
    unmasked and the caller ends those requests, so one broken grammar does not fail the batch.
    """
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    failed: dict[int, Exception] = {}
    if not rows:
        return failed
    bitmask = allocate_bitmask(len(rows), vocab_size)
    for j, i in enumerate(rows):
        try:
            reqs[i].grammar.fill_bitmask(bitmask, j)  # type: ignore[union-attr]
        except Exception as exc:
            failed[i] = exc
            bitmask[j] = -1  # a half-filled row would make sampling fail for nothing
    apply_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.long, device=logits.device))
    return failed
