"""The scheduler's side of constrained decoding: waiting for grammars, masks, jump-forward drafts.

Jump-forward, exact mode (the default): where the grammar forces a continuation, its canonical
tokens become a *draft*. The next forward runs `[last token] + draft` as one extend and returns
logits at every position; the scheduler then samples position by position under the grammar mask
and keeps the draft token while the sampled token equals it, stopping at the first difference
(whose sampled token is kept too). For a draft known in advance (a point distribution), this IS
the speculative-sampling rule: the draft token is accepted with probability p(draft), and on
rejection the emitted token is distributed as p restricted to the other tokens. So outputs
follow exactly the distribution of token-by-token decoding; greedy outputs are identical, and a
seeded request draws one uniform per emitted token, as it would without jump-forward.

Retokenize mode (SGLang's original, kept for comparison): the forced *text* is tokenized on its
own and appended unverified; the model never chose those tokens, so what follows can drift.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglite.runtime.constrained import Constraint, GrammarError, GrammarManager
from sglite.runtime.constrained.bitmask import allocate_bitmask, apply_bitmask
from sglite.runtime.scheduler.request import Req

# Longest draft verified in one forward (forced JSON keys are rarely longer).
MAX_DRAFT_TOKENS = 32


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


def exact_draft(req: Req, context_len: int) -> list[int]:
    """The forced tokens to verify in the next forward (empty when nothing is forced).

    At most MAX_DRAFT_TOKENS, and short enough that the draft plus the model's own next token
    fit in `max_new_tokens` and the context.
    """
    if req.grammar is None:
        return []
    room = min(req.remaining_new_tokens, context_len - req.num_fill) - 1
    if room <= 0:
        return []
    return req.grammar.forced_tokens()[: min(room, MAX_DRAFT_TOKENS)]


def retokenized_forced_tokens(req: Req, encode: Callable[[str], list[int]]) -> list[int]:
    """SGLang's original jump-forward: the forced text, tokenized on its own, as far as the
    grammar takes those tokens (the boundary may differ from what the model would write)."""
    if req.grammar is None:
        return []
    forced = req.grammar.forced_text()
    if not forced:
        return []
    text = forced.decode("utf-8", errors="ignore")
    if not text:
        return []
    tokens = encode(text)
    room = max(0, req.remaining_new_tokens - 1)
    tokens = tokens[:room]
    return tokens[: req.grammar.count_allowed(tokens)]
