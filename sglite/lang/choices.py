"""How `select` turns the model's logprobs of each choice into a decision.

Every method receives, per choice, the logprob entries `[logprob, token_id, token_text]` of the
choice's own tokens (the prompt's tokens are excluded; see `backend/base.py` for how they are
found) and their mean. The three methods are SGLang's:

- `token_length_normalized` (default): the highest mean token logprob.
- `greedy_token_selection`: compare token by token, keeping the choices with the best logprob at
  each position; a shorter choice is padded with its own mean.
- `unconditional_likelihood_normalized`: the highest mean of (conditional − unconditional) token
  logprob, where unconditional logprobs score the choice's tokens without the prompt.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    """The chosen string and the scores that chose it (stored as the variable's meta info)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax_first(values: list[float]) -> int:
    # Ties go to the earliest choice, so decisions are deterministic.
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


class ChoicesSamplingMethod(ABC):
    """A rule that picks one choice from per-token logprobs."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether the backend must also score each choice without the prompt."""
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Position by position, keep the choices whose token logprob is the highest.

    Shorter choices are padded with their own mean logprob, so a choice that is a prefix of a
    longer one competes on its average.
    """

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision:
        width = max(len(entries) for entries in input_token_logprobs)
        matrix: list[list[float]] = []
        for entries in input_token_logprobs:
            values = [float(e[0]) for e in entries]
            matrix.append(values + [_mean(values)] * (width - len(values)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(
            choices[remaining[0]],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": matrix,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The highest mean of (logprob given the prompt − logprob without it) over the choice's
    tokens. The first unconditional logprob has no context and counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional token logprobs are required for this method")
        scores: list[float] = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs differ in length")
            base = [0.0 if e[0] is None else float(e[0]) for e in uncond]
            scores.append(_mean([float(c[0]) - u for c, u in zip(cond, base)]))
        best = _argmax_first(scores)
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
