"""Constrained decoding: regex / JSON schema / EBNF grammars as token masks, and jump-forward.

Importing this package does not import torch (the language front validates constraints with
it); the mask operations live in `constrained.bitmask`."""

from sglite.runtime.constrained.base import (
    CONSTRAINT_KINDS,
    Constraint,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
)
from sglite.runtime.constrained.grammar_manager import (
    GRAMMAR_BACKENDS,
    GrammarManager,
    GrammarTicket,
    create_backend,
    validate_constraint,
)

__all__ = [
    "CONSTRAINT_KINDS",
    "GRAMMAR_BACKENDS",
    "Constraint",
    "GrammarBackend",
    "GrammarError",
    "GrammarManager",
    "GrammarMatcher",
    "GrammarTicket",
    "create_backend",
    "validate_constraint",
]
