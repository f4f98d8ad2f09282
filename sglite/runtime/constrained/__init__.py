"""Constrained decoding: regex / JSON schema / EBNF grammars as token masks, and jump-forward."""

from sglite.runtime.constrained.base import (
    CONSTRAINT_KINDS,
    Constraint,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
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
    "allocate_bitmask",
    "apply_bitmask",
    "create_backend",
    "validate_constraint",
]
