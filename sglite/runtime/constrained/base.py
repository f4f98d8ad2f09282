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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the language front validates without it
    import torch

CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf")


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the grammar parser's own, `kind` the
    constraint it is about (`regex`, `json_schema`, `ebnf`; None when not known)."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


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
