"""The workloads bench_engine gives every system, and how it times them: synthetic prompts of an
exact token count (no dataset download), the shared-prefix workload, the context depth of the
long decode, and the best wall time of a few repeats."""

from __future__ import annotations

import random
import time

# Batch-1 decode is also measured after a prompt of this many tokens (agents and chats decode
# at depth: there attention over the cache, not the weights, sets much of the step's cost).
LONG_CONTEXT = 2000
LONG_DECODE = f"batch-1 decode at {LONG_CONTEXT}-token context"


def make_words(n_tokens: int, seed: int) -> str:
    """Synthetic text of roughly n_tokens tokens (no dataset download needed)."""
    rng = random.Random(seed)
    vocab = (
        "the of and a to in is you that it he was for on are as with his they at be this have "
        "from or one had by word but not what all were we when your can said there use an each "
        "which she do how their if will up other about out many then them these so some her would "
        "make like him into time has look two more write go see number no way could people my "
        "than first water been call who oil its now find long down day did get come made may part"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(n_tokens))


def exact_prompt_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """Token ids of synthetic text cut to exactly n_tokens."""
    ids = tokenizer.encode(make_words(n_tokens * 2, seed))
    return ids[:n_tokens]


def shared_prefix_workload(tokenizer, n_requests: int) -> list[list[int]]:
    """n_requests x (800 shared + 30 distinct tokens)."""
    prefix = exact_prompt_ids(tokenizer, 800, seed=1)
    return [prefix + exact_prompt_ids(tokenizer, 30, seed=100 + i) for i in range(n_requests)]


def best_time(fn, repeats: int) -> float:
    """The shortest wall time (s) of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
