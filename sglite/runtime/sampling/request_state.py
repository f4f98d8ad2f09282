"""The sampling state of one running request: its parameters, seeded generator, output tokens and
the penalty tables kept up to date token by token (`SamplingInfo`, `TokenTable`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglite.runtime.sampling.params import SamplingParams

_SEED_MASK = (1 << 64) - 1


class TokenTable:
    """Distinct token ids and how often each occurred, as growable tensors.

    Penalties touch only tokens that occurred, so the sampler gathers and scatters these few
    hundred entries instead of making passes over [B, vocab] tensors. `add` is amortized O(1)
    (capacity doubles), so a decode step never recounts the history.
    """

    def __init__(self, device: torch.device, tokens: list[int] | None = None) -> None:
        self._pos: dict[int, int] = {}
        self._n = 0
        self._ids = torch.empty(16, dtype=torch.long, device=device)
        self._counts = torch.zeros(16, dtype=torch.float32, device=device)
        if tokens:
            distinct: dict[int, int] = {}
            for t in tokens:
                distinct[t] = distinct.get(t, 0) + 1
            self._reserve(len(distinct))
            self._pos = {t: i for i, t in enumerate(distinct)}
            self._n = len(distinct)
            self._ids[: self._n] = torch.tensor(list(distinct), dtype=torch.long)
            self._counts[: self._n] = torch.tensor(list(distinct.values()), dtype=torch.float32)

    def add(self, token: int) -> None:
        """Count one more occurrence of `token`."""
        pos = self._pos.get(token)
        if pos is None:
            self._reserve(self._n + 1)
            pos = self._pos[token] = self._n
            self._ids[pos] = token
            self._n += 1
        self._counts[pos] += 1

    @property
    def ids(self) -> torch.Tensor:
        """The distinct tokens, [n] int64."""
        return self._ids[: self._n]

    @property
    def counts(self) -> torch.Tensor:
        """Occurrences of each of `ids`, [n] float32 (all >= 1)."""
        return self._counts[: self._n]

    def __len__(self) -> int:
        return self._n

    def _reserve(self, n: int) -> None:
        cap = self._ids.shape[0]
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        ids = torch.empty(cap, dtype=torch.long, device=self._ids.device)
        counts = torch.zeros(cap, dtype=torch.float32, device=self._ids.device)
        ids[: self._n] = self._ids[: self._n]
        counts[: self._n] = self._counts[: self._n]
        self._ids, self._counts = ids, counts


@dataclass
class SamplingInfo:
    """Sampling state of one running request.

    The info owns `output_ids`: the scheduler reports each new token through `on_token`, which
    also updates the penalty tables, so a decode step never recounts the history. The tables
    exist only for requests that use penalties (built on first use).
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Prompt + output tokens (repetition penalty) and output tokens (frequency/presence).
    _seen: TokenTable | None = field(default=None, repr=False)
    _output: TokenTable | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        device: torch.device | str = "cpu",
        output_ids: list[int] | None = None,
    ) -> SamplingInfo:
        """A fresh info; a CPU generator seeded from `params.seed` when one is given."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed & _SEED_MASK)
        return cls(
            params=params,
            prompt_ids=list(prompt_ids),
            output_ids=list(output_ids or []),
            generator=generator,
            device=torch.device(device),
        )

    @property
    def uses_repetition_penalty(self) -> bool:
        """True when prompt+output tokens are penalized multiplicatively."""
        return self.params.repetition_penalty != 1.0

    @property
    def uses_additive_penalties(self) -> bool:
        """True when output tokens are penalized by count (frequency) or presence."""
        return self.params.frequency_penalty != 0.0 or self.params.presence_penalty != 0.0

    def skip_draw(self) -> None:
        """Advance a seeded sampled request's generator past one token's draw, as if this
        process had sampled it (a decode server taking over after the prefill server's first
        token)."""
        if self.generator is not None and not self.params.is_greedy:
            torch.rand(1, generator=self.generator)

    def on_token(self, token_id: int) -> None:
        """Record a generated token (appends to `output_ids`, updates the penalty tables)."""
        self.output_ids.append(token_id)
        if self._seen is not None:
            self._seen.add(token_id)
        if self._output is not None:
            self._output.add(token_id)

    def seen_tokens(self) -> TokenTable:
        """Distinct tokens of prompt + output (built on first call, then kept up to date)."""
        if self._seen is None:
            self._seen = TokenTable(self.device, self.prompt_ids + self.output_ids)
        return self._seen

    def output_tokens(self) -> TokenTable:
        """Distinct output tokens with counts (built on first call, then kept up to date)."""
        if self._output is None:
            self._output = TokenTable(self.device, self.output_ids)
        return self._output

    def release(self) -> None:
        """Drop the penalty tables (the request finished)."""
        self._seen = None
        self._output = None
