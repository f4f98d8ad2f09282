"""The grammar backend interface: what the scheduler needs from a constrained-decoding engine.

A *constraint* is `(kind, text)` with kind one of `regex`, `json_schema`, `ebnf`. A backend
compiles it once (compiled grammars are cached by the caller, `GrammarManager`) into a
`GrammarMatcher` template; each request gets its own `copy()`.

Matcher invariants:
- the matcher has consumed exactly the request's generated tokens (`accept_token` per token, in
  order; `rollback(n)` undoes the last n);
- `fill_bitmask(mask, row)` writes the allowed next tokens as bits (token t allowed iff bit
  `t % 32` of `mask[row, t // 32]` is set, the layout llguidance and xgrammar share); EOS is
  allowed exactly when the grammar accepts the text so far;
- `forced_tokens()` are tokens the grammar allows and that every valid continuation starts with,
  in the tokenizer's canonical tokenization (a draft for jump-forward, never applied unverified
  in exact mode);
- `is_terminated()` is true when nothing but EOS may follow: the request is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf")


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the grammar parser's own."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: `kind` in CONSTRAINT_KINDS and its source text."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise GrammarError(
                f"unknown constraint kind {self.kind!r}; use one of {CONSTRAINT_KINDS}"
            )


class GrammarMatcher(ABC):
    """Per-request grammar state (see the module docstring for its invariants)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 `[B, ceil(V/32)]` bitmask."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens every valid continuation starts with (canonical tokenization); may be empty."""

    @abstractmethod
    def forced_text(self) -> bytes:
        """Bytes every valid continuation starts with (may extend past `forced_tokens`)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when only EOS may follow (the constrained output is complete)."""

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state."""

    def count_allowed(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here (state unchanged)."""
        probe = self.copy()
        for i, t in enumerate(token_ids):
            if not probe.accept_token(t):
                return i
        return len(token_ids)


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer/vocabulary into matchers."""

    name: str = ""

    @abstractmethod
    def compile(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for `constraint`; raises GrammarError with the parser's message."""


def allocate_bitmask(
    batch: int, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An int32 `[batch, ceil(vocab/32)]` bitmask with every token allowed."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set disallowed tokens of `logits[rows]` to -inf, in place, in one vectorised op.

    `bitmask` is `[len(rows), words]`: its row i masks logits row `rows[i]`.
    """
    device = logits.device
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    vocab = logits.shape[-1]
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
