"""The default grammar backend, on `llguidance` (Rust, no further dependencies).

Why llguidance: its masks are computed lazily over a token trie (tens of microseconds per step
for JSON), it compiles JSON schemas and regexes in milliseconds, and its forced ("fast-forward")
tokens are the canonical tokenization of the forced bytes, so a jump-forward draft is made of
tokens the model would normally produce.

JSON schemas compile with fixed separators (`", "` and `": "`, no free whitespace): the output
is the JSON a model usually writes, and the text between values becomes forced, which is what
jump-forward exploits. GBNF-style EBNF (`root ::= ...`, as SGLang and xgrammar take it) is
converted to Lark; text without `::=` is taken as a Lark grammar.
"""

from __future__ import annotations

import copy
import json
import threading
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from sglite.runtime.constrained.base import (
    Constraint,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
)

if TYPE_CHECKING:  # imported where used: validation must not pull in torch or transformers
    import torch

    from sglite.runtime.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_llguidance_grammar(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; GrammarError when its text is malformed."""
    kind, text = constraint.kind, constraint.text
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("json_schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"json_schema: {exc}") from None
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain exceptions on bad input
            raise GrammarError(f"ebnf: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def validate_constraint(constraint: Constraint) -> None:
    """Raise GrammarError with the parser's message if the constraint does not compile.

    Needs no tokenizer, so the HTTP front can answer 400 before the request is queued.
    """
    grammar = to_llguidance_grammar(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid {constraint.kind}: {messages[0].strip()}")


class LLGuidanceMatcher(GrammarMatcher):
    """A request's llguidance matcher; extra EOS ids are allowed wherever EOS is."""

    def __init__(
        self, matcher: llguidance.LLMatcher, eos_token_id: int, extra_eos_ids: list[int]
    ) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id  # the EOS llguidance knows
        self.extra_eos_ids = extra_eos_ids  # the model's other stop tokens, treated alike

    def accept_token(self, token_id: int) -> bool:
        """Consume one token; False (and an error state) if the grammar forbids it."""
        if token_id in self.extra_eos_ids and self.matcher.is_accepting():
            token_id = self.eos_token_id
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Allowed next tokens as bits in `bitmask[row]`."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.extra_eos_ids and self.matcher.is_accepting():
            for t in self.extra_eos_ids:
                if t // 32 < bitmask.shape[1]:
                    word = int(bitmask[row, t // 32]) | (1 << (t % 32))
                    bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def forced_tokens(self) -> list[int]:
        """llguidance's fast-forward tokens."""
        return list(self.matcher.compute_ff_tokens())

    def forced_text(self) -> bytes:
        """llguidance's forced bytes."""
        return bytes(self.matcher.compute_ff_bytes())

    def is_terminated(self) -> bool:
        """Only EOS may follow (also true in an error state)."""
        return self.matcher.is_stopped()

    def count_allowed(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar allows in order (llguidance checks in place)."""
        return self.matcher.validate_tokens(list(token_ids))

    def copy(self) -> LLGuidanceMatcher:
        """An independent copy."""
        return LLGuidanceMatcher(self.matcher.deep_copy(), self.eos_token_id, self.extra_eos_ids)


class LLGuidanceBackend(GrammarBackend):
    """Compiles constraints with llguidance for one model's tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._model_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.5 s), on the first compile's worker thread
            if self._tokenizer is None:
                # llguidance reads the tokenizer's own JSON (as its `hf.from_tokenizer` does,
                # without needing transformers), padding and truncation off.
                backend = copy.copy(self._model_tokenizer.backend)
                backend.no_padding()
                backend.no_truncation()
                self._tokenizer = llguidance.LLTokenizer(
                    backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=self._model_tokenizer.eos_token_id,
                )
            return self._tokenizer

    def compile(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher; GrammarError with llguidance's message if the grammar is invalid."""
        grammar = to_llguidance_grammar(constraint)
        tokenizer = self._ll_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {constraint.kind}: {matcher.get_error().strip()}")
        eos = tokenizer.eos_token
        return LLGuidanceMatcher(matcher, eos, [t for t in self._eos_token_ids if t != eos])
