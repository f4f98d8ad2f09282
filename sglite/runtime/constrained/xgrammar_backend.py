"""An optional grammar backend on `xgrammar` (SGLang's default engine), behind the same interface.

Install it with `scripts/install_xgrammar.sh` (or `pip install 'sglite[xgrammar]'`, which on
Linux x86_64 also pulls `triton`, a large GPU compiler xgrammar only uses for GPU mask kernels).
Nothing here needs triton: masks are filled on the CPU by xgrammar's C++ core and applied by
`sglite.runtime.constrained.bitmask.apply_bitmask`.

Behaviour matches the llguidance backend where the interface asks for it:
- JSON schemas use the fixed separators `", "` and `": "` with no free whitespace (xgrammar's
  `any_whitespace=False`), so the text between values is forced;
- EBNF is GBNF style (`root ::= ...`), which xgrammar parses natively;
- all the model's EOS ids are xgrammar stop tokens, so each is allowed exactly where EOS is;
- a rejected token puts the matcher in a sticky error state (`is_terminated()` true, the mask
  allows only EOS), as llguidance does.

xgrammar's jump-forward gives a string, not tokens: `forced_tokens()` is the string's
tokenization by the Hugging Face tokenizer, without its last token (which could merge with the
text that follows) unless the string is all the grammar still allows, and cut at the first
token the matcher does not accept.
"""

from __future__ import annotations

import json
import re
import threading

import torch
import xgrammar

from sglite.runtime.constrained.base import (
    Constraint,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
)
from sglite.runtime.tokenizer import Tokenizer

JSON_SEPARATORS = (", ", ": ")  # the same as llguidance_backend.JSON_OPTIONS

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")

# Exceptions xgrammar raises for a bad grammar (its own InvalidJSONError is a RuntimeError).
_PARSE_ERRORS = (RuntimeError, ValueError, TypeError)


def _message(exc: BaseException) -> str:
    """xgrammar's error message without its log prefix."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def _json_schema_text(text: str) -> str:
    """The schema text, checked to be a JSON object or boolean."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("json_schema must be a JSON object")
    return json.dumps(schema)


def validate_constraint(constraint: Constraint) -> None:
    """Raise GrammarError with xgrammar's message if the constraint does not compile.

    Needs no tokenizer, so the HTTP front can answer 400 before the request is queued.
    """
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "regex":
            xgrammar.Grammar.from_regex(text)
        elif kind == "json_schema":
            xgrammar.Grammar.from_json_schema(
                _json_schema_text(text), any_whitespace=False, separators=JSON_SEPARATORS
            )
        else:
            xgrammar.Grammar.from_ebnf(text)
    except GrammarError:
        raise
    except _PARSE_ERRORS as exc:
        raise GrammarError(f"invalid {kind}: {_message(exc)}") from None


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int, value: bool = True) -> None:
    """Allow (or forbid) `token_id` in `bitmask[row]`; int32 words, so bit 31 is the sign."""
    word = int(bitmask[row, token_id // 32]) & 0xFFFFFFFF
    bit = 1 << (token_id % 32)
    word = word | bit if value else word & ~bit
    bitmask[row, token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word


class XGrammarMatcher(GrammarMatcher):
    """A request's xgrammar matcher, with the tokens it accepted (to replay on copy)."""

    def __init__(
        self,
        matcher: xgrammar.GrammarMatcher,
        compiled: xgrammar.CompiledGrammar,
        tokenizer: Tokenizer,
        stop_token_ids: list[int],
        vocab_size: int,
        accepted: list[int] | None = None,
        error: bool = False,
    ) -> None:
        self.matcher = matcher
        self.compiled = compiled  # to rebuild a matcher when the installed xgrammar cannot fork
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids  # every EOS id of the model
        self.vocab_size = vocab_size
        self.accepted = list(accepted or [])
        self.error = error  # a token was rejected: sticky, as in llguidance
        self._version = 0  # bumped by every accept and rollback: keys the is_terminated cache
        self._only_eos_cache: tuple[int, bool] | None = None  # (version, answer)

    # -- state ------------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        """Consume one token; False (and a sticky error state) if the grammar forbids it."""
        if self.error or self.matcher.is_terminated():
            self.error = True
            return False
        if not self.matcher.accept_token(token_id):
            self.error = True
            return False
        self.accepted.append(token_id)
        self._version += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last tokens (an error state stays, as in llguidance)."""
        num_tokens = min(num_tokens, len(self.accepted))
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            del self.accepted[-num_tokens:]
            self._version += 1

    def _stopped(self) -> bool:
        """An EOS was accepted, or a token was rejected: only EOS may be written."""
        return self.error or self.matcher.is_terminated()

    def _only_eos_follows(self, matcher: xgrammar.GrammarMatcher) -> bool:
        """The grammar accepts the text so far and allows no further token but EOS."""
        if not matcher.is_completed():
            return False
        mask = torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask, 0)
        for t in self.stop_token_ids:
            if 0 <= t < self.vocab_size:
                _set_bit(mask, 0, t, False)
        return not bool(mask.any())

    def is_terminated(self) -> bool:
        """Only EOS may follow (also true after EOS and in an error state)."""
        if self._stopped():
            return True
        if self._only_eos_cache is None or self._only_eos_cache[0] != self._version:
            self._only_eos_cache = (self._version, self._only_eos_follows(self.matcher))
        return self._only_eos_cache[1]

    # -- masks ------------------------------------------------------------------------------

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Allowed next tokens as bits in `bitmask[row]` (EOS only once stopped)."""
        if self._stopped():
            bitmask[row].zero_()
            for t in self.stop_token_ids:
                if 0 <= t // 32 < bitmask.shape[1]:
                    _set_bit(bitmask, row, t)
            return
        if bitmask.device.type == "cpu" and bitmask.is_contiguous():
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            tmp = torch.empty((1, bitmask.shape[1]), dtype=torch.int32)
            self.matcher.fill_next_token_bitmask(tmp, 0)
            bitmask[row].copy_(tmp[0])

    # -- jump-forward -----------------------------------------------------------------------

    def _jump_forward_string(self) -> str:
        if self._stopped():
            return ""
        try:
            return self.matcher.find_jump_forward_string()
        except UnicodeDecodeError:  # the matcher is inside a multi-byte character
            return ""

    def forced_text(self) -> bytes:
        """xgrammar's jump-forward string, as UTF-8 bytes."""
        return self._jump_forward_string().encode("utf-8")

    def forced_tokens(self) -> list[int]:
        """The forced string's tokens that the grammar accepts (may be fewer, or none)."""
        text = self._jump_forward_string()
        if not text:
            return []
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            return []
        probe = self._fork()
        whole = probe.accept_string(text) and self._only_eos_follows(probe)
        if not whole:
            ids = ids[:-1]  # the last token may merge with what the model writes next
        for i, t in enumerate(ids):
            if t in self.stop_token_ids:  # a special token spelled out in the forced text
                ids = ids[:i]
                break
        return ids[: self.count_allowed(ids)]

    def count_allowed(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar allows in order (accepted, then rolled back)."""
        if self._stopped():
            return 0
        n = 0
        for t in token_ids:
            if not self.matcher.accept_token(t):  # a rejected token leaves xgrammar unchanged
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    # -- copies -----------------------------------------------------------------------------

    def _fork(self) -> xgrammar.GrammarMatcher:
        """An independent xgrammar matcher in this state (`fork`, else a replay)."""
        fork = getattr(self.matcher, "fork", None)
        if fork is not None:
            return fork()
        matcher = xgrammar.GrammarMatcher(self.compiled)
        for t in self.accepted:
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar matcher replay rejected token {t}")
        return matcher

    def copy(self) -> XGrammarMatcher:
        """An independent copy."""
        return XGrammarMatcher(
            self._fork(),
            self.compiled,
            self.tokenizer,
            self.stop_token_ids,
            self.vocab_size,
            self.accepted,
            self.error,
        )


class XGrammarBackend(GrammarBackend):
    """Compiles constraints with xgrammar for one model's tokenizer."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._stop_token_ids: list[int] = []
        self._lock = threading.Lock()

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:  # built once (it reads the whole vocabulary), by the first compile
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer.hf,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._eos_token_ids or None,
                )
                self._stop_token_ids = list(info.stop_token_ids)
                # GrammarManager caches compiled grammars (bounded); xgrammar's own cache is not.
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher; GrammarError with xgrammar's message if the grammar is invalid."""
        kind, text = constraint.kind, constraint.text
        schema = _json_schema_text(text) if kind == "json_schema" else ""
        compiler = self._get_compiler()
        try:
            if kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(
                    schema, any_whitespace=False, separators=JSON_SEPARATORS
                )
            else:
                compiled = compiler.compile_grammar(text)
        except _PARSE_ERRORS as exc:
            raise GrammarError(f"invalid {kind}: {_message(exc)}") from None
        return XGrammarMatcher(
            xgrammar.GrammarMatcher(compiled),
            compiled,
            self._tokenizer,
            self._stop_token_ids,
            self._vocab_size,
        )
