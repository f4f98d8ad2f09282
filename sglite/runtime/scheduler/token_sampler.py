"""Sampling a batch's logits into its requests: grammar masks, the sampler, then the output.

Row i of the logits is sampled for request i and the token appended (`OutputProcessor`); a
constrained request near the end of its budget that asked for it is steered to close its
structure (`structure_closing.py`). A request whose own part fails (its grammar, NaN logits,
detokenizing) ends alone with an internal-error abort; the rest of the batch goes on.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sglite.runtime.sampling.sampler import Sampler
from sglite.runtime.scheduler.drafts import RetokenizingJump
from sglite.runtime.scheduler.grammar import apply_grammar_masks
from sglite.runtime.scheduler.output import OutputProcessor, TopLogprobs
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.structure_closing import StructureCloser


class FirstTokenTaker(Protocol):
    """Takes some requests' first token instead of the output (a prefill server hands the
    request to its decode server with it)."""

    def takes_token(self, req: Req) -> bool: ...

    def append_first_token(
        self, req: Req, tok: int, logprob: float | None, top: TopLogprobs | None
    ) -> None: ...


class TokenSampler:
    """Samples and appends tokens for a batch of requests (see module docstring)."""

    def __init__(
        self,
        sampler: Sampler,
        vocab_size: int,
        eos_token_ids: list[int],
        output: OutputProcessor,
        closer: StructureCloser | None = None,
        first_token_taker: FirstTokenTaker | None = None,
        retokenizer: RetokenizingJump | None = None,
    ) -> None:
        self.sampler = sampler
        self.closer = closer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.output = output
        self.first_token_taker = first_token_taker
        self.retokenizer = retokenizer

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample row i of `logits` for reqs[i] and append it (see module docstring)."""
        failed = apply_grammar_masks(reqs, logits, self.vocab_size)
        if self.closer is not None:
            for i, req in enumerate(reqs):
                in_string = None if i in failed else self.closer.closing(req)
                if in_string is not None:
                    self.closer.favour(logits, i, in_string)
                    req.closing_structure = True
        result = self.sampler.sample(
            logits,
            [r.sampling for r in reqs],
            self.eos_token_ids,
            [r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            return_logprobs=[r.return_logprob for r in reqs],
        )
        for i in result.invalid_rows:
            failed.setdefault(i, FloatingPointError("the model's logits were NaN or all -inf"))
        for i, req in enumerate(reqs):
            if i in failed:
                self.output.fail(req, failed[i])
                continue
            tok = result.next_token_ids[i]
            top = result.top_logprobs[i] if result.top_logprobs else None
            try:
                self._append(req, tok, result.logprobs[i], top)
            except Exception as exc:
                self.output.fail(req, exc)

    def _append(self, req: Req, tok: int, logprob: float | None, top: TopLogprobs | None) -> None:
        """Append a token the model chose; in retokenize mode, then the forced text after it."""
        taker = self.first_token_taker
        if taker is not None and taker.takes_token(req):
            taker.append_first_token(req, tok, logprob, top)
            return
        self.output.append_token(req, tok, logprob, top)
        if self.retokenizer is not None and req.grammar is not None and not req.finished:
            self.retokenizer.jump(req, lambda r, t: self.output.append_token(r, t, None, None))
