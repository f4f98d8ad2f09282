"""LLM as a judge with branch-solve-merge (the paper's LLM-judge workload).

Models: Saha et al.'s Branch-Solve-Merge for pairwise evaluation, as in SGLang's LLM-judge
benchmark: a question and two responses; the program `fork`s one branch per criterion
(branch), each branch writes a short evaluation and `select`s the better response on that
criterion (solve), and the root lists the per-criterion verdicts, `select`s the overall
winner and `gen`s a short justification (merge).

Data: synthesised factual questions, each with a correct, helpful response and a flawed one
(a wrong fact, or an evasive reply), in random order. No download.

Sharing: the judge's instruction (about 60 tokens) is shared by all requests; within a request
the question and both responses (about 50 tokens) are the prefix of the 4 criterion branches
and of the merge step.
"""

from __future__ import annotations

from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import (
    assert_choice,
    assert_list,
    assert_ok,
    assert_str,
    get_var,
    greedy_gen,
    rng_for,
    state_choice,
    state_str,
)

CRITERIA = ["helpfulness", "factual accuracy", "clarity", "conciseness"]
VERDICTS = [" A", " B", " tie"]

INSTRUCTION = (
    "Please act as an impartial judge and compare the two AI assistant responses to the user "
    "question below. Judge each criterion separately: write a short evaluation, then say which "
    "response is better on that criterion (A, B or tie). Do not let the order or the length "
    "of the responses influence you.\n\n"
)
# (question, correct answer, a plausible wrong answer)
FACTS = [
    ("What is the boiling point of water at sea level?", "100 degrees Celsius", "80 degrees"),
    ("How many continents are there?", "seven", "five"),
    ("Which planet is closest to the Sun?", "Mercury", "Venus"),
    ("What gas do plants absorb from the air?", "carbon dioxide", "oxygen"),
    ("Who wrote the play Romeo and Juliet?", "William Shakespeare", "Charles Dickens"),
    ("What is the largest ocean on Earth?", "the Pacific Ocean", "the Atlantic Ocean"),
    ("How many legs does a spider have?", "eight", "six"),
    ("What is the freezing point of water?", "0 degrees Celsius", "10 degrees Celsius"),
    ("Which organ pumps blood through the body?", "the heart", "the liver"),
    ("What is the capital of Australia?", "Canberra", "Sydney"),
]


def _responses(rng: Any, correct: str, wrong: str) -> tuple[str, str]:
    """A good response and a flawed one (wrong fact, or evasive), in that order."""
    good = f"The answer is {correct}. This is a well-established fact you can rely on."
    if rng.random() < 0.5:
        bad = f"I believe it is {wrong}, although I may be mistaken about that."
    else:
        bad = "That is a complicated question and it depends on many things, so it is hard to say."
    return good, bad


@sgl.function
def llm_judge(s, question, answer_a, answer_b):
    s += INSTRUCTION + f"[Question]\n{question}\n\n"
    s += f"[Response A]\n{answer_a}\n\n[Response B]\n{answer_b}\n\n"
    branches = s.fork(len(CRITERIA))
    branches += lambda i: f"[Criterion: {CRITERIA[i]}]\nEvaluation:"
    branches += greedy_gen("evaluation", 32, stop="\n")
    branches += "\nBetter response:" + sgl.select("criterion_verdict", choices=VERDICTS)
    branches.join()

    s += "[Verdicts per criterion]\n"
    for criterion, verdict in zip(CRITERIA, s["criterion_verdict"]):
        s += f"{criterion}:{verdict}\n"
    s += "\nOverall better response:" + sgl.select("verdict", choices=VERDICTS)
    s += "\nExplanation:" + greedy_gen("explanation", 24, stop="\n")


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` questions with a good and a flawed response in random order."""
    args = []
    for i in range(num_requests):
        rng = rng_for(seed, "judge", i)
        question, correct, wrong = FACTS[rng.randrange(len(FACTS))]
        good, bad = _responses(rng, correct, wrong)
        a, b = (good, bad) if rng.random() < 0.5 else (bad, good)
        args.append({"question": question, "answer_a": a, "answer_b": b})
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """One evaluation and verdict per criterion, an overall verdict and an explanation."""
    assert_ok(state)
    evaluations = assert_list(get_var(state, "evaluation"), "evaluation", len(CRITERIA))
    for i, text in enumerate(evaluations):
        assert_str(text, f"evaluation[{i}]")
    verdicts = get_var(state, "criterion_verdict")
    assert_list(verdicts, "criterion_verdict", len(CRITERIA))
    for i, verdict in enumerate(verdicts):
        assert_choice(verdict, f"criterion_verdict[{i}]", VERDICTS)
    state_choice(state, "verdict", VERDICTS)
    state_str(state, "explanation")


WORKLOAD = Workload(
    name="llm_judge",
    description="LLM judge, branch-solve-merge: fork 4 criteria (gen + select), merge select + gen",
    program=llm_judge,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=64,
    quick_num_requests=8,
)
