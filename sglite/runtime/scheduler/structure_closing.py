"""Closing a constrained answer before its budget runs out (`close_structure_on_length`).

A JSON answer or tool call cut by `max_new_tokens` does not parse. For a request that asks,
the tokens that close its structure are favoured over every other token its grammar allows
once its remaining budget is down to what closing takes: inside a string, the tokens that end
it (`"`, `"}`, `"]}`, ...); outside one, runs of `}` and `]`, then, less, a `,` (it ends a
number, or a value where the object still needs a key, instead of the value growing); and the
end-of-sequence tokens. So a string is closed at once, a number ends, an object ends as soon
as its required keys are there (a missing key is still written, its value short).

What closing takes is measured on a copy of the request's grammar: the closing path above is
walked token by token (forced tokens as forced; where nothing favoured is allowed, the longest
allowed token) until the grammar ends, and the path's length plus `CLOSE_MARGIN` is the room
kept. The walk runs only in the last `WINDOW` tokens of the budget; once closing starts it
stays on. The request then ends by its grammar or by length, its answer parsing either way,
and its finish reason says `length` (it was cut short).

Invariant: the bias only raises allowed tokens; a token the grammar masked stays impossible.
"""

from __future__ import annotations

import torch

from sglite.runtime.constrained import GrammarMatcher
from sglite.runtime.constrained.bitmask import allocate_bitmask, allowed_tokens
from sglite.runtime.scheduler.request import Req
from sglite.runtime.tokenizer import Tokenizer
from sglite.runtime.tool_calls.json_scan import JsonNesting

# Tokens kept beyond the measured closing path (the model may need a token to leave a place
# the walk left at once, such as a number's last digit).
CLOSE_MARGIN = 2
# The closing path is measured only this near the end of the budget, and walked at most this
# far (a structure that needs more is closed as far as the budget goes).
WINDOW = 64
# Added to the logits of closing tokens: far above any logit gap, finite so that a masked
# (-inf) token stays -inf.
CLOSING_BIAS = 1.0e4
SEPARATOR_BIAS = 0.5e4
_CLOSING_CHARS = frozenset('"}]')


class StructureCloser:
    """Favours closing tokens for requests near the end of their budget (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # Built on first use (they decode the vocabulary): each token's text and its length,
        # and the biases outside a string and inside one.
        self._texts: list[str] = []
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._biases: tuple[torch.Tensor, torch.Tensor] | None = None

    def closing(self, req: Req) -> bool | None:
        """None unless `req` asked to close its structure and its budget is down to what that
        takes (from then on it stays closing); else whether its output ends inside a string."""
        if not req.params.close_structure_on_length or req.grammar is None:
            return None
        if not req.closing_structure:
            remaining = req.remaining_new_tokens
            if remaining > WINDOW or remaining > self.closing_cost(req) + CLOSE_MARGIN:
                return None
        return JsonNesting.of(req.output_text).in_string

    def favour(self, logits: torch.Tensor, row: int, in_string: bool) -> None:
        """Raise the closing tokens of `logits[row]`, in place."""
        outside, inside = self.closing_biases()
        bias = (inside if in_string else outside)[: logits.shape[-1]].to(logits.device)
        logits[row] += bias.to(logits.dtype)

    def closing_cost(self, req: Req) -> int:
        """Tokens the closing path takes from `req`'s state (at most `WINDOW`)."""
        assert req.grammar is not None
        matcher: GrammarMatcher = req.grammar.copy()
        outside, inside = self.closing_biases()
        texts = self._texts
        in_string = JsonNesting.of(req.output_text).in_string
        bitmask = allocate_bitmask(1, self.vocab_size)
        for steps in range(WINDOW):
            if matcher.is_terminated():
                return steps
            forced = matcher.forced_tokens()
            if forced:
                token = forced[0]
            else:
                matcher.fill_bitmask(bitmask, 0)
                allowed = allowed_tokens(bitmask[0], self.vocab_size)
                if not bool(allowed.any()):
                    return steps
                token = self._closing_choice(allowed, inside if in_string else outside)
            if not matcher.accept_token(token):
                return steps
            if token < len(texts):
                in_string = _ends_in_string(texts[token], in_string)
        return WINDOW

    def _closing_choice(self, allowed: torch.Tensor, bias: torch.Tensor) -> int:
        """The allowed token the closing path takes: the most favoured, else the longest."""
        favoured = torch.where(allowed, bias, torch.full_like(bias, -1.0))
        best = int(favoured.argmax())
        if favoured[best] > 0:
            return best
        lengths = self._lengths
        return int(torch.where(allowed, lengths, torch.full_like(lengths, -1)).argmax())

    def closing_biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float `[vocab_size]` biases outside a string (`CLOSING_BIAS` for runs of `}` and `]`,
        `SEPARATOR_BIAS` for a `,`, whitespace allowed around both) and inside one
        (`CLOSING_BIAS` for a `"` followed only by closing characters), the end-of-sequence
        tokens `CLOSING_BIAS` in both."""
        if self._biases is None:
            ids = list(range(min(self.vocab_size, self.tokenizer.vocab_size)))
            self._texts = self.tokenizer.decode_each(ids)
            self._lengths = torch.zeros(self.vocab_size, dtype=torch.long)
            self._lengths[: len(ids)] = torch.tensor([len(t) for t in self._texts])
            outside = torch.zeros(self.vocab_size)
            inside = torch.zeros(self.vocab_size)
            for token_id, text in zip(ids, self._texts, strict=True):
                text = text.strip()
                if text == ",":
                    outside[token_id] = SEPARATOR_BIAS
                elif not text or not set(text) <= _CLOSING_CHARS:
                    continue
                elif text.startswith('"'):
                    inside[token_id] = CLOSING_BIAS
                elif '"' not in text:
                    outside[token_id] = CLOSING_BIAS
            for token_id in self.eos_token_ids:
                if 0 <= token_id < self.vocab_size:
                    outside[token_id] = inside[token_id] = CLOSING_BIAS
            self._biases = (outside, inside)
        return self._biases


def _ends_in_string(text: str, in_string: bool) -> bool:
    """Whether JSON text that is (or is not) inside a string is inside one after `text`."""
    return JsonNesting.of(('"' if in_string else "") + text).in_string
