"""`RequestLimits`: the checks a request passes before it is queued, and the request they make.

Everything the scheduler could only fail on later is refused here with a ValueError (a 400 over
HTTP) naming the problem: ids outside the vocabulary, a prompt or prompt + `max_new_tokens` past
the context length or the KV pool, `n` or `max_new_tokens` past the server's bounds, a grammar
that does not compile, bad logprob options, segment spans outside the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglite.runtime.constrained import validate_constraint
from sglite.runtime.multimodal.processor import ImageItem, is_pad
from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.scheduler.io import check_segments
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizing.request import GenerateRequest


class ContextLengthError(ValueError):
    """The prompt (with its output budget) does not fit the model's context: OpenAI clients
    know this 400 by its code, `context_length_exceeded`."""


@dataclass(frozen=True)
class RequestLimits:
    """What every request must fit: the served model's and the server's bounds (fixed for the
    life of a TokenizerManager)."""

    vocab_size: int
    context_len: int
    max_total_tokens: int  # the KV pool
    max_n: int  # --max-n
    max_new_tokens_limit: int | None  # --max-new-tokens-limit
    grammar_backend: str

    @classmethod
    def of(cls, args: ServerArgs, info: dict[str, Any]) -> RequestLimits:
        """The limits of a server with `args` whose scheduler reported `info`."""
        return cls(
            vocab_size=info["vocab_size"],
            context_len=info["context_length"],
            max_total_tokens=info["max_total_num_tokens"],
            max_n=args.max_n,
            max_new_tokens_limit=args.max_new_tokens_limit,
            grammar_backend=args.grammar_backend,
        )

    def request(
        self,
        ids: Any,
        params: dict[str, Any],
        rid: str,
        return_logprob: bool,
        logprob_start_len: Any,
        top_logprobs_num: Any,
        return_text_in_logprobs: bool,
        images: list[ImageItem],
        segments: list[Any],
    ) -> GenerateRequest:
        """The request for one prompt's token ids `ids` (image spans already in them) and its
        sampling parameters, or a ValueError naming the first check it fails."""
        if segments:
            problem = check_segments(segments, len(ids))
            if problem:
                raise ValueError(problem)
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("input_ids must be a list of integers (or a list of such lists)")
        if not ids:
            raise ValueError("the prompt is empty: it has no tokens")
        pads = {i.offset + p for i in images for p in i.feature_positions} if images else ()
        bad = [
            t for k, t in enumerate(ids) if t >= self.vocab_size or (is_pad(t) and k not in pads)
        ]
        if bad:
            raise ValueError(
                f"input_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})"
            )
        parsed = SamplingParams.from_dict(params)
        if parsed.n > self.max_n:
            raise ValueError(f"n must be <= {self.max_n} (--max-n), got {parsed.n}")
        limit = self.max_new_tokens_limit
        if limit is not None and parsed.max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens must be <= {limit} (--max-new-tokens-limit), "
                f"got {parsed.max_new_tokens}"
            )
        if parsed.constraint is not None:
            # Refuse a grammar that does not compile here (400), before it is queued.
            validate_constraint(*parsed.constraint, backend=self.grammar_backend)
        if len(ids) >= self.context_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        if len(ids) + parsed.max_new_tokens > self.context_len:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({parsed.max_new_tokens}) exceeds "
                f"the context length ({self.context_len})"
            )
        if len(ids) + parsed.max_new_tokens > self.max_total_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({parsed.max_new_tokens}) exceeds "
                f"the KV cache pool ({self.max_total_tokens} tokens)"
            )
        start = -1 if logprob_start_len is None else logprob_start_len
        if not isinstance(start, int) or start < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start!r}")
        top = 0 if top_logprobs_num is None else top_logprobs_num
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise ValueError(f"top_logprobs_num must be an integer in [0, 20], got {top!r}")
        return GenerateRequest(
            input_ids=ids,
            sampling_params=parsed.to_dict(),
            rid=str(rid),
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top,
            return_text_in_logprobs=return_text_in_logprobs,
            images=images,
            segments=[tuple(span) for span in segments],
        )
