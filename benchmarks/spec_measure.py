"""bench_spec's measurements: an engine's decode rate with prefill left out, the n-gram
ceiling of an answer, and one system's tally of rates and draft counts over a workload's rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

import sglite


def batch_run(
    engine: sglite.Engine, prompt: str, tokens: int, n: int = 1, reask: bool = False
) -> tuple[float, list[dict], list[list[int]]]:
    """(decode tok/s of all `n` copies of `prompt` run at once, each run's meta_info, each
    answer's ids) from a flushed cache with the prompt cached beforehand (with `reask`, the
    whole answer too), by a request that decodes a token, as after a conversation's earlier
    turn. Streamed: the rate counts the tokens written from the moment every request has its
    first token to the last one's end, so prefill (and a draft model's pass over a prompt,
    which runs with it) drops out, whichever prompts it reads."""
    params = {"temperature": 0, "max_new_tokens": 1}
    engine.flush_cache()
    engine.generate(prompt, {**params, "max_new_tokens": tokens if reask else 2})
    runs = asyncio.run(_streamed(engine, prompt, {**params, "max_new_tokens": tokens}, n))
    start = max(seen[0][0] for seen, _ in runs)  # every request has its first token
    end = max(seen[-1][0] for seen, _ in runs)
    done = sum(seen[-1][1] - max(count for at, count in seen if at <= start) for seen, _ in runs)
    metas = [final["meta_info"] for _, final in runs]
    return done / max(end - start, 1e-9), metas, [final["output_ids"] for _, final in runs]


async def _streamed(
    engine: sglite.Engine, prompt: str, params: dict, n: int
) -> list[tuple[list[tuple[float, int]], dict]]:
    """`n` streams of `prompt` at once: each one's (arrival time, tokens written so far) per
    chunk, and its last chunk."""

    async def one() -> tuple[list[tuple[float, int]], dict]:
        seen, final = [], {}
        async for chunk in await engine.async_generate(prompt, params, stream=True):
            seen.append((time.perf_counter(), chunk["meta_info"]["completion_tokens"]))
            final = chunk
        return seen, final

    return list(await asyncio.gather(*(one() for _ in range(n))))


def decode_run(
    engine: sglite.Engine, prompt: str, tokens: int, reask: bool
) -> tuple[float, dict, list]:
    """`batch_run` of one request: (decode tok/s, its meta_info, its output ids)."""
    rate, metas, ids = batch_run(engine, prompt, tokens, 1, reask)
    return rate, metas[0], ids[0]


def ngram_ceiling(context: list[int], answer: list[int], cap: int) -> float:
    """Tokens per forward that an oracle n-gram drafter would reach on `answer`: at every step
    it drafts, from any earlier position of `context + answer so far`, the continuation that
    matches the most of what the model writes next (up to `cap` tokens). No drafter that copies
    from the request's own text does better, so below 2 the answer copies too little for n-gram
    speculation to double the decode rate, whatever the lookup rule."""
    forwards, done = 0, 0
    while done < len(answer):
        seen, upcoming = context + answer[:done], answer[done : done + cap]
        best = 0
        for start in range(len(seen)):
            n = 0
            while n < len(upcoming) and start + n < len(seen) and seen[start + n] == upcoming[n]:
                n += 1
            best = max(best, n)
        done += best + 1  # the accepted draft and the model's own next token
        forwards += 1
    return len(answer) / max(forwards, 1)


@dataclass
class Tally:
    """One system's rates and draft counts over the rounds of one workload."""

    rates: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def acceptance(self) -> str:
        return f"{100 * self.accepted / self.drafted:.0f}%" if self.drafted else "-"
