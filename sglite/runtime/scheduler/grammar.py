"""The scheduler's side of constrained decoding: waiting for grammars, and vocabulary masks.

Requests whose grammar is still compiling wait in the request table's `GRAMMAR` status;
`GrammarQueue` submits their compilation (on worker threads, so it never stalls other requests'
forward passes) and tells which are done. Each sampling step masks the rows
of constrained requests in one vectorised op. Jump-forward, which drafts the tokens a grammar
forces, lives in `drafts.py`.
"""

from __future__ import annotations

import torch

from sglite.runtime.constrained import Constraint, GrammarError, GrammarManager
from sglite.runtime.constrained.bitmask import allocate_bitmask, apply_bitmask
from sglite.runtime.scheduler.request import Req


class GrammarQueue:
    """Starts requests' grammar compilations and tells which are done (`poll`)."""

    def __init__(self, manager: GrammarManager, timeout_s: float) -> None:
        self.manager = manager
        self.timeout_s = timeout_s

    def add(self, req: Req, constraint: tuple[str, str]) -> None:
        """Start compiling `req`'s constraint; raises GrammarError for an unknown kind."""
        req.grammar_ticket = self.manager.submit(Constraint(*constraint))

    def poll(self, compiling: list[Req]) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Of the `compiling` requests, (those now holding their matcher, (request, error
        message) for those whose grammar failed); the others are still compiling."""
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        for req in compiling:
            assert req.grammar_ticket is not None
            result = req.grammar_ticket.result(self.timeout_s)
            if isinstance(result, GrammarError):
                failed.append((req, str(result)))
            elif result is not None:
                req.grammar, req.grammar_ticket = result, None
                ready.append(req)
        return ready, failed


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
