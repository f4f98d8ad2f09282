"""Speculative decoding: what every draft source shares, and the one that the flags choose.

A `Speculator` proposes a request's draft for the next decode step (the scheduler verifies it
with `drafts.DraftVerifier`), learns how much of it was accepted, and forgets finished requests.
Two exist: n-gram lookup in the request's own text (`ngram.py`) and a draft model
(`draft_model.py`). Both keep, per request, a copy of its tokens extended by the new ones
(`TokenHistory`) and a draft length adapted to its acceptance (`DraftLength`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sglite.runtime.scheduler.request import Req

if TYPE_CHECKING:
    from sglite.runtime.model.loader import LoadedModel
    from sglite.runtime.server_args import ServerArgs

# A request whose acceptance falls below this share (over at least PAUSE_AFTER drafted
# tokens) stops drafting for PAUSE_STEPS proposals: verification rows cost compute.
LOW_ACCEPTANCE = 0.2
PAUSE_AFTER = 16
PAUSE_STEPS = 16


class Speculator(Protocol):
    """A speculative draft source (a `drafts.DraftProposer` that learns from verification)."""

    def propose(self, req: Req) -> list[int]:
        """The request's draft, within the `DraftProposer.propose` bound; empty for none."""
        ...

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A verification of `req`'s draft kept `accepted` of its `drafted` tokens."""
        ...

    def forget(self, live: set[str]) -> None:
        """Release what is kept for requests not in `live` (finished, aborted, retracted)."""
        ...

    def flush(self) -> None:
        """Drop what is cached across requests (the server's cache flush)."""
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError when the speculator's own KV accounting is broken."""
        ...

    def info(self) -> dict[str, Any]:
        """What get_server_info reports of the speculator."""
        ...


@dataclass
class DraftLength:
    """One request's draft length: it doubles while whole drafts are accepted, shrinks to just
    past what was accepted, and drafting pauses for a while when most drafts are rejected."""

    maximum: int
    current: int = 0
    drafted: int = 0  # over the current acceptance window
    accepted: int = 0
    paused: int = 0  # proposals left to skip

    def __post_init__(self) -> None:
        self.current = self.current or self.maximum

    def next(self, room: int) -> int:
        """Tokens to draft now (0 while paused), at most `room`."""
        if self.paused:
            self.paused -= 1
            return 0
        return max(0, min(room, self.current))

    def record(self, drafted: int, accepted: int) -> None:
        """Adapt to a verification's result."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.maximum, self.current * 2)
        else:
            self.current = max(1, accepted + 1)
        self.drafted += drafted
        self.accepted += accepted
        if self.drafted >= PAUSE_AFTER:
            if self.accepted < LOW_ACCEPTANCE * self.drafted:
                self.paused = PAUSE_STEPS
                self.current = self.maximum
            self.drafted = self.accepted = 0


@dataclass
class TokenHistory:
    """A request's prompt and output so far, extended by the new tokens only (building
    `req.fill_ids` every step would copy the whole sequence on the decode path)."""

    tokens: list[int] = field(default_factory=list)

    def sync(self, req: Req) -> list[int]:
        """The tokens, brought up to the request's prompt and output."""
        if not self.tokens:
            self.tokens = list(req.prompt_ids)
        self.tokens.extend(req.output_ids[len(self.tokens) - len(req.prompt_ids) :])
        return self.tokens


# The guard's probes: where speculation does not pay, every SPEC_PROBE_EVERY-th step at that
# batch size speculates anyway (the workload may have turned copy-heavy); where it pays, every
# PLAIN_PROBE_EVERY-th step does not (a plain step's cost is the model's, it changes little, and
# a plain step forgoes a whole draft). A verdict needs MIN_SAMPLES measured steps of each kind.
SPEC_PROBE_EVERY = 8
PLAIN_PROBE_EVERY = 64
MIN_SAMPLES = 2
# Weight of the newest step in the moving average: low, so that the verdict follows the cost
# structure (model sizes, batch size, how much the workload copies), not one rejected draft.
COST_SMOOTHING = 0.125


@dataclass
class StepCost:
    """A moving average of decode-step seconds per emitted token."""

    seconds_per_token: float = 0.0
    samples: int = 0

    def observe(self, seconds: float, tokens: int) -> None:
        value = seconds / max(tokens, 1)
        if self.samples:
            value = (1 - COST_SMOOTHING) * self.seconds_per_token + COST_SMOOTHING * value
        self.seconds_per_token = value
        self.samples += 1


class SpeculationGuard:
    """Keeps speculation on only where it pays: per batch size, the measured time per emitted
    token of decode steps that verified speculative drafts against that of steps that did not.

    Speculation alternates with plain steps until both are measured; then probes of the other
    way (see `SPEC_PROBE_EVERY`) keep both measures current, so a request that starts copying
    its input turns speculation back on. Proposing is part of a speculative step's time (a
    draft model's passes included)."""

    def __init__(self) -> None:
        self.costs: dict[tuple[int, bool], StepCost] = {}
        self.steps: dict[int, int] = {}

    def should_speculate(self, batch_size: int) -> bool:
        """Whether this step (of `batch_size` running requests) proposes speculative drafts."""
        step = self.steps.get(batch_size, 0)
        self.steps[batch_size] = step + 1
        if self._learning(batch_size):
            return step % 2 == 0
        if self.pays(batch_size):
            return step % PLAIN_PROBE_EVERY != PLAIN_PROBE_EVERY - 1
        return step % SPEC_PROBE_EVERY == SPEC_PROBE_EVERY - 1

    def pays(self, batch_size: int) -> bool:
        """True until both kinds of step are measured, then whether speculative steps cost
        less per emitted token."""
        if self._learning(batch_size):
            return True
        spec, plain = self.costs[batch_size, True], self.costs[batch_size, False]
        return spec.seconds_per_token <= plain.seconds_per_token

    def _learning(self, batch_size: int) -> bool:
        """Fewer than `MIN_SAMPLES` steps of either kind measured (every other step is then a
        plain one)."""
        kinds = (self.costs.get((batch_size, True)), self.costs.get((batch_size, False)))
        return any(cost is None or cost.samples < MIN_SAMPLES for cost in kinds)

    def observe(self, batch_size: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode step took `seconds` and emitted `tokens`; `speculated`: it verified at
        least one speculative draft."""
        self.costs.setdefault((batch_size, speculated), StepCost()).observe(seconds, tokens)

    def info(self) -> dict[str, Any]:
        """Per batch size: the two costs (ms per token) and whether speculation pays."""
        sizes = sorted({size for size, _ in self.costs})
        out = {}
        for size in sizes:
            spec, plain = self.costs.get((size, True)), self.costs.get((size, False))
            out[str(size)] = {
                "speculative_ms_per_token": spec and 1e3 * spec.seconds_per_token,
                "plain_ms_per_token": plain and 1e3 * plain.seconds_per_token,
                "pays": self.pays(size),
            }
        return out


def draft_room(req: Req, context_len: int) -> int:
    """Most draft tokens `req` can take: the draft plus the model's own next token fit in its
    budget and context."""
    return min(req.remaining_new_tokens, context_len - req.num_fill) - 1


def build_speculator(
    args: ServerArgs, target: LoadedModel, context_len: int, capacity: int
) -> Speculator | None:
    """The speculator `args` ask for (None when speculation is off). A draft model is loaded
    here, its KV pool sized to `capacity` tokens like the target's."""
    if args.speculative_algorithm == "ngram":
        from sglite.runtime.scheduler.ngram import NgramProposer

        return NgramProposer(
            context_len,
            args.speculative_num_draft_tokens,
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
        )
    if args.speculative_algorithm == "draft":
        from sglite.runtime.scheduler.draft_model import DraftModelProposer

        return DraftModelProposer.load(args, target, context_len, capacity)
    return None
