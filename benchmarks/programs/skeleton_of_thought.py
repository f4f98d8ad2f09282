"""Skeleton of thought: outline, then expand every point in parallel (the paper's SoT workload).

Models: Ning et al.'s Skeleton-of-Thought: the model first writes a short skeleton of the
answer (here one short `gen` per outline point, so there are always exactly 3 points), then
`fork`s one branch per point that expands it, in parallel; `join("concate_and_append")`
appends the expansions to the answer in order (SoT's final answer is their concatenation).

Data: synthesised how-to and explain-why questions from templates. No download.

Sharing: an instruction with a worked example (about 135 tokens) shared by all requests; within
a request the question and the whole skeleton are the prefix of the 3 expansion branches.
"""

from __future__ import annotations

from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import (
    assert_list,
    assert_ok,
    assert_str,
    get_var,
    greedy_gen,
    rng_for,
    state_str,
)

NUM_POINTS = 3

INSTRUCTION = """You answer in two stages. First write a skeleton: 3 short points of a few \
words each. Then expand each point in one or two sentences.

Question: How can I sleep better?
Skeleton:
1. Keep a regular schedule
2. Avoid screens before bed
3. Keep the bedroom dark
Expansion:
1. Keep a regular schedule: Go to bed and get up at the same time every day, even on weekends.
2. Avoid screens before bed: Screen light keeps the brain awake; stop an hour before bed.
3. Keep the bedroom dark: A dark, quiet, cool room makes it easier to fall and stay asleep.

"""
TOPICS = ["learn a new language", "save money each month", "start running", "keep a garden",
          "write a good essay", "prepare for a job interview", "cook healthy meals",
          "reduce stress at work", "make friends in a new city", "study for an exam"]  # fmt: skip
WHY = ["is the sky blue", "do leaves change colour in autumn", "does bread rise",
       "does ice float on water", "do people yawn", "is the sea salty", "do cats purr",
       "does metal feel cold"]  # fmt: skip


@sgl.function
def skeleton_of_thought(s, question):
    s += INSTRUCTION + "Question: " + question + "\nSkeleton:\n"
    for i in range(1, NUM_POINTS + 1):
        # ":" ends a point too: it starts an expansion (the example's format), not a title.
        s += f"{i}." + greedy_gen(f"point_{i}", 12, stop=["\n", ":"]) + "\n"
    s += "Expansion:\n"
    branches = s.fork(NUM_POINTS)
    # Each branch restates its point (SoT's point-expanding prompt), so greedy branches differ.
    branches += lambda i: f"{i + 1}.{s[f'point_{i + 1}']}:"
    branches += greedy_gen("expansion", 32, stop="\n") + "\n"
    # Read before joining: concatenation appends the text but gathers no variables.
    expansions = [branch["expansion"] for branch in branches]
    branches.join("concate_and_append")
    s["expansions"] = expansions


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` questions, alternately how-to and explain-why."""
    args = []
    for i in range(num_requests):
        rng = rng_for(seed, "sot", i)
        if i % 2 == 0:
            question = f"How can I {rng.choice(TOPICS)}?"
        else:
            question = f"Why {rng.choice(WHY)}?"
        args.append({"question": question})
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """3 outline points, 3 expansions, and the expansions appended to the text."""
    assert_ok(state)
    for i in range(1, NUM_POINTS + 1):
        state_str(state, f"point_{i}")
    expansions = assert_list(get_var(state, "expansions"), "expansions", NUM_POINTS)
    for i, text in enumerate(expansions):
        assert_str(text, f"expansions[{i}]")
    body = state.text().rsplit("Expansion:\n", 1)[-1]
    points = [state[f"point_{i}"] for i in range(1, NUM_POINTS + 1)]
    expected = "".join(f"{i}.{p}:{e}\n" for i, (p, e) in enumerate(zip(points, expansions), 1))
    assert body == expected, f"joined text {body!r} is not the expansions in order"


WORKLOAD = Workload(
    name="skeleton_of_thought",
    description="skeleton of thought: 3 outline gens, fork 3 parallel expansions, concatenate",
    program=skeleton_of_thought,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=64,
    quick_num_requests=8,
)
