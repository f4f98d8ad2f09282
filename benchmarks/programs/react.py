"""ReAct agent trajectories (the paper's ReAct workload).

Models: Yao et al.'s ReAct on HotpotQA-style questions, replayed as SGLang's benchmark does:
a long instruction with worked trajectories, then the question and a fixed number of steps,
each `Thought i:` (gen), `Action i:` (select among the tools), the tool's argument (gen) and
`Observation i:` (constant text from the trace, appended whatever the model chose, so every
system does the same work).

Data: synthesised two-hop questions about fictional people, books and towns, with the
observations a search over that fictional world would return. No download.

Sharing: every request starts with the same instruction and worked examples (about 440
tokens); within a request each step's call extends the previous call's prompt and output, so
the trajectory so far is always in the cache (multi-call reuse).
"""

from __future__ import annotations

from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, greedy_gen, rng_for, state_choice, state_str

TOOLS = [" Search", " Lookup", " Finish"]
NUM_STEPS = 3

INSTRUCTION = """Solve a question answering task with interleaving Thought, Action, Observation \
steps. Thought can reason about the current situation, and Action can be three types:
(1) Search[entity], which searches the exact entity on Wikipedia and returns the first \
paragraph if it exists.
(2) Lookup[keyword], which returns the next sentence containing keyword in the current passage.
(3) Finish[answer], which returns the answer and finishes the task.
Here are some examples.

Question: Which river flows through the city where the painter Anna Vale was born?
Thought 1: I need to search Anna Vale, find where she was born, then find the river there.
Action 1: Search[Anna Vale]
Observation 1: Anna Vale (1851-1920) was a landscape painter born in Greywick.
Thought 2: Anna Vale was born in Greywick. I need to search Greywick.
Action 2: Search[Greywick]
Observation 2: Greywick is a market town on the banks of the river Lune.
Thought 3: The river Lune flows through Greywick, so the answer is the Lune.
Action 3: Finish[the Lune]

Question: In what year was the publisher of the novel Salt Harbour founded?
Thought 1: I need to find the publisher of Salt Harbour, then when it was founded.
Action 1: Search[Salt Harbour]
Observation 1: Salt Harbour is a 1932 novel by Iris Penn, published by Marlow House.
Thought 2: The publisher is Marlow House. I need to look up when it was founded.
Action 2: Search[Marlow House]
Observation 2: Marlow House is a publishing company in Eastby. It was founded in 1887.
Thought 3: Marlow House was founded in 1887.
Action 3: Finish[1887]

"""

FIRST = ["Tomas", "Lena", "Oskar", "Mira", "Felix", "Nora", "Hugo", "Ada", "Emil", "Ines"]
LAST = ["Brandt", "Castell", "Dorne", "Falk", "Hale", "Ivers", "Kemp", "Lorne", "Marsh"]
TOWNS = ["Ashcombe", "Brightwater", "Coldharbour", "Dunmere", "Elmstead", "Fenwick", "Kirkby"]
RIVERS = ["Avon", "Wye", "Tamar", "Ouse", "Dart", "Exe"]
BOOKS = ["The Glass Orchard", "Winter Lanterns", "A House of Reeds", "The Iron Coast"]


def _trajectory(seed: int, index: int) -> dict[str, Any]:
    """One question and the observations its (replayed) trajectory sees."""
    rng = rng_for(seed, "react", index)
    author = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    book, town, river = rng.choice(BOOKS), rng.choice(TOWNS), rng.choice(RIVERS)
    year = rng.randint(1850, 1990)
    question = f"Which river flows through the town where the author of {book} was born?"
    observations = [
        f"{book} is a {year} novel by {author}.",
        f"{author} is a writer, born in {town} in {year - rng.randint(25, 50)}.",
        f"{town} is a small town on the river {river}, known for its old stone bridge.",
    ]
    return {"question": question, "observations": observations}


@sgl.function
def react(s, question, observations):
    s += INSTRUCTION + "Question: " + question + "\n"
    for i, observation in enumerate(observations, start=1):
        s += f"Thought {i}:" + greedy_gen(f"thought_{i}", 24, stop="\n")
        s += f"\nAction {i}:" + sgl.select(f"action_{i}", choices=TOOLS)
        s += "[" + greedy_gen(f"action_input_{i}", 12, stop=["]", "\n"]) + "]\n"
        s += f"Observation {i}: {observation}\n"


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` questions, each with the observations of its steps."""
    return [_trajectory(seed, i) for i in range(num_requests)]


def check(state: Any, args: dict[str, Any]) -> None:
    """Every step has a thought, an action among the tools and the action's input."""
    assert_ok(state)
    for i in range(1, len(args["observations"]) + 1):
        state_str(state, f"thought_{i}")
        state_choice(state, f"action_{i}", TOOLS)
        state_str(state, f"action_input_{i}")


WORKLOAD = Workload(
    name="react",
    description=f"ReAct agent: {NUM_STEPS} steps of Thought (gen), Action (select), input (gen)",
    program=react,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=100,
    quick_num_requests=8,
)
