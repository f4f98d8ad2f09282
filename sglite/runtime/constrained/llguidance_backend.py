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
import re
import threading
from dataclasses import dataclass
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


def to_llguidance_grammar(constraint: Constraint, special: dict[str, int] | None = None) -> str:
    """The llguidance grammar of a constraint; GrammarError when its text is malformed.

    `special`: the model's special tokens by text; an `ebnf` string literal spelling one is
    rewritten to name the token (`name_special_tokens`).
    """
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
    return llguidance.LLMatcher.grammar_from_lark(name_special_tokens(text, special or {}))


def name_special_tokens(lark: str, special: dict[str, int]) -> str:
    """`lark` with each string literal that spells one of the `special` tokens split around it,
    the token written by id (`"<tool_call>\\n"` -> `(<[151657]> "\\n")`): the model writes such a
    token whole, and llguidance matches it only by name, never through a literal's bytes. The
    JSON of `%json` schemas is left as it is."""
    if not special or not any(token in lark for token in special):
        return lark
    out, pos = [], 0
    for m in _LARK_STRING_OR_JSON.finditer(lark):
        if m.start() < pos:
            continue  # inside a `%json` schema already copied
        out.append(lark[pos : m.start()])
        pos = m.end()
        literal = m.group(0)
        if literal.startswith("%json"):
            end = _json_end(lark, lark.index("{", m.start()))
            out.append(lark[m.start() : end])
            pos = end
            continue
        out.append(_split_literal(literal, special))
    out.append(lark[pos:])
    return "".join(out)


def _split_literal(literal: str, special: dict[str, int]) -> str:
    try:
        text = json.loads(literal)
    except json.JSONDecodeError:
        return literal  # an escape JSON does not know: left to the grammar engine
    pattern = "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))
    pieces = [p for p in re.split(f"({pattern})", text) if p]
    if len(pieces) == 1 and pieces[0] not in special:
        return literal
    parts = [f"<[{special[p]}]>" if p in special else json.dumps(p) for p in pieces]
    return "(" + " ".join(parts) + ")"


def _json_end(text: str, start: int) -> int:
    """The index after the JSON object starting at `text[start]` (`{`)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def validate_constraint(constraint: Constraint) -> None:
    """Raise GrammarError with the parser's message if the constraint does not compile.

    Needs no tokenizer, so the HTTP front can answer 400 before the request is queued.
    """
    grammar = to_llguidance_grammar(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid {constraint.kind}: {messages[0].strip()}")


# A Lark string literal (read left to right, so a closing quote never opens one), or the start
# of a `%json` schema (whose JSON strings are not Lark literals).
_LARK_STRING_OR_JSON = re.compile(r'"(?:[^"\\\n]|\\.)*"|%json\s*\{')


@dataclass(frozen=True)
class MaskFixes:
    """What a matcher clears from llguidance's mask: `forbidden` (bitmask words of ids never
    generated: past the tokenizer's vocabulary, or marked unused by the model's file, such as a
    GGUF's `[PAD151665]` padding rows, whose text llguidance would otherwise allow), and any of
    `special_ids` (added tokens such as Qwen's `<tool_call>`, EOS excepted) that llguidance
    allows but would reject (it does so for a text literal spelling a special token)."""

    forbidden: torch.Tensor
    special_ids: tuple[int, ...]


class LLGuidanceMatcher(GrammarMatcher):
    """A request's llguidance matcher; extra EOS ids are allowed wherever EOS is.

    Invariant: `fill_bitmask` allows only tokens `accept_token` accepts, and raises when the
    grammar allows none (an engine inconsistency, not the request's fault)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        eos_token_id: int,
        extra_eos_ids: list[int],
        fixes: MaskFixes,
    ) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id  # the EOS llguidance knows
        self.extra_eos_ids = extra_eos_ids  # the model's other stop tokens, treated alike
        self.fixes = fixes

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
        self._clear_unacceptable(bitmask[row])
        if self.extra_eos_ids and self.matcher.is_accepting():
            for t in self.extra_eos_ids:
                if t // 32 < bitmask.shape[1]:
                    _set_bit(bitmask[row], t, True)
        if not bool(bitmask[row].any()):
            raise RuntimeError(
                "constrained decoding: the grammar engine allows no next token "
                f"({self.matcher.get_error() or 'no error reported'})"
            )

    def _clear_unacceptable(self, words: torch.Tensor) -> None:
        words.bitwise_and_(self.fixes.forbidden.bitwise_not())
        for t in self.fixes.special_ids:
            if _bit(words, t) and self.matcher.validate_tokens([t]) == 0:
                _set_bit(words, t, False)

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
        return LLGuidanceMatcher(
            self.matcher.deep_copy(), self.eos_token_id, self.extra_eos_ids, self.fixes
        )


class LLGuidanceBackend(GrammarBackend):
    """Compiles constraints with llguidance for one model's tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._model_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._fixes: MaskFixes | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (it reads the whole vocabulary), by the first compile
            if self._tokenizer is None:
                # llguidance reads the tokenizer's own JSON (as its `hf.from_tokenizer` does,
                # without needing transformers), padding and truncation off.
                backend = copy.copy(self._model_tokenizer.backend)
                backend.no_padding()
                backend.no_truncation()
                tokenizer = llguidance.LLTokenizer(
                    backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=self._model_tokenizer.eos_token_id,
                )
                added = backend.get_added_tokens_decoder()
                eos = {tokenizer.eos_token, *self._eos_token_ids}
                special = [i for i in added if tokenizer.is_special_token(i) and i not in eos]
                self._fixes = MaskFixes(self._forbidden_words(), tuple(sorted(special)))
                self._tokenizer = tokenizer
            return self._tokenizer

    def _forbidden_words(self) -> torch.Tensor:
        import torch

        never = [*self._model_tokenizer.unused_token_ids]
        never += range(len(self._model_tokenizer), self._vocab_size)
        bits = torch.zeros((self._vocab_size + 31) // 32 * 32, dtype=torch.bool)
        bits[[i for i in never if i < self._vocab_size]] = True
        weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
        words = (bits.view(-1, 32).to(torch.int64) * weights).sum(1)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def _special_tokens(self) -> dict[str, int]:
        """The text of each special token llguidance matches only by name, and its id."""
        assert self._fixes is not None
        ids = self._fixes.special_ids
        return dict(zip(self._model_tokenizer.convert_ids_to_tokens(list(ids)), ids, strict=True))

    def compile(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher; GrammarError with llguidance's message if the grammar is invalid."""
        tokenizer = self._ll_tokenizer()
        grammar = to_llguidance_grammar(constraint, self._special_tokens())
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {constraint.kind}: {matcher.get_error().strip()}")
        eos = tokenizer.eos_token
        extra_eos = [t for t in self._eos_token_ids if t != eos]
        assert self._fixes is not None  # set with the tokenizer
        return LLGuidanceMatcher(matcher, eos, extra_eos, self._fixes)


def _bit(words: torch.Tensor, t: int) -> bool:
    return t // 32 < words.shape[0] and bool((int(words[t // 32]) >> (t % 32)) & 1)


def _set_bit(words: torch.Tensor, t: int, on: bool) -> None:
    word = int(words[t // 32]) & 0xFFFFFFFF
    word = word | (1 << (t % 32)) if on else word & ~(1 << (t % 32))
    words[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
