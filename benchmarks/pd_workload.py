"""bench_pd's workload: each round's seeded open-loop schedule (short chat requests and long
prompts, Poisson arrivals), the same for both setups.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from benchmarks.common import PromptMaker

LONG_OUTPUT_TOKENS = 4


@dataclass
class Arrival:
    """One request of the schedule: when it is sent (s after the round starts) and what."""

    kind: str  # "short" or "long"
    at: float
    text: str
    max_new_tokens: int


def chat(maker: PromptMaker, message: str) -> str:
    """`message` as a user turn in the model's chat template, ready for the assistant."""
    return maker.tokenizer.apply_chat_template([{"role": "user", "content": message}])


def poisson_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    """Arrival times of a Poisson process of `rate`/s within [0, duration)."""
    times: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def schedule(maker: PromptMaker, args: argparse.Namespace, round_no: int) -> list[Arrival]:
    """Round `round_no`'s requests, seeded, so both setups get the same ones."""
    rng = random.Random(args.seed * 1000 + round_no)
    out = []
    for i, t in enumerate(poisson_times(rng, args.short_rate, args.duration)):
        message = f"Question {i}: " + maker.text(rng.randint(20, 40))
        out.append(Arrival("short", t, chat(maker, message), args.short_tokens))
    for i, t in enumerate(poisson_times(rng, args.long_rate, args.duration)):
        message = f"Report {round_no}-{i}. Summarize it.\n" + maker.text(args.long_prompt_tokens)
        out.append(Arrival("long", t, chat(maker, message), LONG_OUTPUT_TOKENS))
    return sorted(out, key=lambda a: a.at)
