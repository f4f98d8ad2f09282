"""Renames in an edited copy: where the model writes its own token in place of a copied one
and then the token that followed it in the source, the replacement is the request's
substitution (`NgramState.substitute`), carried into later drafts (ngram.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.runtime.scheduler.ngram import NgramState


@dataclass(frozen=True)
class Replacement:
    """The model's own token, at position `written_at` of the request, written where a draft
    copied the token at text position `source_at`."""

    source_at: int
    written_at: int


def note_replacement(state: NgramState, drafted: int, accepted: int) -> None:
    """After a verification of a copied draft: note where the model's own token after the
    accepted ones stands against the source's, for `confirm_replacement` (after a rejected
    draft, or one accepted whole, it may be a rename); a substituted token the model did
    not write is forgotten."""
    if state.draft_start is None:
        return
    if accepted < min(drafted, len(state.copied)):
        state.forget_substitution(state.copied[accepted])
    state.pending.append(Replacement(state.draft_start + accepted, state.proposed_at + accepted))


def confirm_replacement(state: NgramState, tokens: list[int]) -> None:
    """Once the token after a noted replacement is written: when it is the one that
    followed the replaced token in the source, the replacement is a substitution."""
    waiting = []
    for pending in state.pending:
        if pending.written_at + 1 >= len(tokens):
            waiting.append(pending)
            continue
        source, written = tokens[pending.source_at], tokens[pending.written_at]
        if written != source and tokens[pending.written_at + 1] == tokens[pending.source_at + 1]:
            state.substitute(source, written)
    state.pending = waiting
