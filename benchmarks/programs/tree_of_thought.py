"""Tree of thought, 3 branches x 2 levels (the paper's Tree-of-Thought workload).

Models: Yao et al.'s Tree of Thoughts as in SGLang's tree-of-thought benchmark on GSM8K-style
problems: the question forks into 3 approaches (level 1: each `gen`s a plan), each approach
forks into 3 solution attempts (level 2: each `gen`s a solution and `select`s a verdict), and
the root aggregates: it lists the plans with their verdict counts, `select`s the most promising
approach and `gen`s the final answer. 3 + 9 generations and 9 + 1 selects per request.

Greedy decoding would make identical branches identical, so every branch's prompt names a
different approach / attempt style.

Data: synthesised arithmetic word problems from templates. No download.

Sharing: a short instruction shared by all requests; within a request the question is the
prefix of all 12 branches, and each plan is the prefix of its 3 attempts (a tree of prefixes:
`fork` commits the text before branching, so every branch starts from the cache).
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
    state_choice,
    state_str,
)

BRANCHES = 3
APPROACHES = ["reason step by step", "write one equation", "work backwards from the goal"]
ATTEMPTS = ["compute it directly", "break it into two parts", "check each number twice"]
YES_NO = [" yes", " no"]
BEST = [" 1", " 2", " 3"]

INSTRUCTION = """Solve the math problem. First propose an approach, then try solutions that \
follow it, and judge whether each is correct.

Question: A shop sells 4 boxes of 12 eggs. How many eggs is that?
Approach 1 (reason step by step): Find the eggs in one box, then multiply by the boxes.
Attempt 1 (compute it directly): 4 * 12 = 48, so the shop sells 48 eggs.
Is this solution correct? Answer: yes

"""
PROBLEMS = [
    "A baker makes {a} muffins a day and packs them in boxes of {b}. How many boxes does she "
    "fill in {c} days?",
    "A train travels {a} km every hour for {c} hours, then {b} km more. How far does it go?",
    "Sam has {a} marbles, gives {b} to each of his {c} friends. How many marbles are left?",
    "A garden has {c} rows of {a} plants. {b} plants die. How many plants are still alive?",
]


@sgl.function
def tree_of_thought(s, question):
    s += INSTRUCTION + "Question: " + question + "\n"
    plans = s.fork(BRANCHES)
    plans += lambda i: f"Approach {i + 1} ({APPROACHES[i]}):"
    plans += greedy_gen("plan", 24, stop="\n")
    # Fork every plan before joining any, so the 9 attempts run concurrently.
    levels = []
    for plan in plans:
        attempts = plan.fork(BRANCHES)
        attempts += lambda j: f"\nAttempt {j + 1} ({ATTEMPTS[j]}):"
        attempts += greedy_gen("solution", 24, stop="\n")
        attempts += "\nIs this solution correct? Answer:" + sgl.select("verdict", YES_NO)
        levels.append(attempts)
    for attempts in levels:
        attempts.join()
    plans.join()

    s += "\nCandidate approaches:\n"
    for i, (plan, verdicts) in enumerate(zip(s["plan"], s["verdict"])):
        correct = sum(v == " yes" for v in verdicts)
        s += f"{i + 1}.{plan} ({correct} of {BRANCHES} attempts judged correct)\n"
    s += "The most promising approach is number" + sgl.select("best", choices=BEST)
    s += ".\nFinal answer:" + greedy_gen("answer", 16, stop="\n")


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` word problems."""
    args = []
    for i in range(num_requests):
        rng = rng_for(seed, "tot", i)
        template = rng.choice(PROBLEMS)
        a, b, c = rng.randint(60, 99), rng.randint(2, 9), rng.randint(2, 6)
        args.append({"question": template.format(a=a, b=b, c=c)})
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """3 plans, 3 x 3 solutions and verdicts, a best approach and an answer."""
    assert_ok(state)
    for i, plan in enumerate(assert_list(get_var(state, "plan"), "plan", BRANCHES)):
        assert_str(plan, f"plan[{i}]")
    for name in ("solution", "verdict"):
        for i, row in enumerate(assert_list(get_var(state, name), name, BRANCHES)):
            for j, item in enumerate(assert_list(row, f"{name}[{i}]", BRANCHES)):
                assert_str(item, f"{name}[{i}][{j}]")
                if name == "verdict":
                    assert item in YES_NO, f"'verdict[{i}][{j}]': {item!r} not yes/no"
    state_choice(state, "best", BEST)
    state_str(state, "answer")


WORKLOAD = Workload(
    name="tree_of_thought",
    description="tree of thought: fork 3 plans x 3 attempts (gen + select), select + gen to merge",
    program=tree_of_thought,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=32,
    quick_num_requests=4,
)
