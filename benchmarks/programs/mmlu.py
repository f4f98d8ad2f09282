"""MMLU-style 5-shot multiple choice (the paper's MMLU workload).

Models: Hendrycks et al.'s MMLU evaluated 5-shot: a subject header, five worked questions of
that subject, then the test question and `select` over the letters A-D (the model's most likely
letter, the standard MMLU scoring).

Data: synthesised questions in four subjects (arithmetic, capitals, unit conversions, chemical
symbols), each with three wrong options drawn from the same pool; no download.

Sharing: every request of a subject starts with that subject's identical 5-shot prefix (170-240
tokens), so requests form four groups sharing a long prefix; only the question (30-45 tokens)
differs. Requests are assigned to subjects round-robin.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, rng_for, state_choice

LETTERS = ["A", "B", "C", "D"]
NUM_SHOTS = 5

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Peru": "Lima", "Norway": "Oslo", "Spain": "Madrid", "Chile": "Santiago",
    "Greece": "Athens", "Poland": "Warsaw", "Ireland": "Dublin", "Portugal": "Lisbon",
    "Austria": "Vienna", "Thailand": "Bangkok", "Argentina": "Buenos Aires", "Cuba": "Havana",
}  # fmt: skip
ELEMENTS = {
    "hydrogen": "H", "helium": "He", "carbon": "C", "nitrogen": "N", "oxygen": "O",
    "sodium": "Na", "iron": "Fe", "copper": "Cu", "silver": "Ag", "gold": "Au", "lead": "Pb",
    "potassium": "K", "calcium": "Ca", "zinc": "Zn", "tin": "Sn", "mercury": "Hg",
}  # fmt: skip
# (larger unit, smaller unit, how many smaller units in one larger)
UNITS = [
    ("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("hours", "minutes", 60),
    ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("days", "hours", 24),
    ("liters", "milliliters", 1000), ("feet", "inches", 12), ("weeks", "days", 7),
]  # fmt: skip

Question = tuple[str, list[str], str]  # (question text, four options, correct letter)


def _options(rng: random.Random, correct: str, pool: list[str]) -> tuple[list[str], str]:
    """The correct option and three distinct distractors from `pool`, shuffled."""
    # sorted: set order of strings changes with PYTHONHASHSEED, the draw must not.
    distractors = rng.sample(sorted(set(pool) - {correct}), 3)
    options = [correct, *distractors]
    rng.shuffle(options)
    return options, LETTERS[options.index(correct)]


def _arithmetic(rng: random.Random) -> Question:
    a, b = rng.randint(12, 89), rng.randint(12, 89)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    pool = [str(value + d) for d in (-10, -2, -1, 1, 2, 10, 11)]
    options, letter = _options(rng, str(value), pool)
    return f"What is {a} {op} {b}?", options, letter


def _capital(rng: random.Random) -> Question:
    country = rng.choice(sorted(CAPITALS))
    options, letter = _options(rng, CAPITALS[country], sorted(CAPITALS.values()))
    return f"What is the capital city of {country}?", options, letter


def _units(rng: random.Random) -> Question:
    big, small, factor = rng.choice(UNITS)
    amount = rng.randint(2, 9)
    value = amount * factor
    others = [amount * 10, amount * 100, value * 10, value + factor, value // 2, value * 2]
    pool = [str(v) for v in others]
    options, letter = _options(rng, str(value), pool)
    return f"How many {small} are there in {amount} {big}?", options, letter


def _chemistry(rng: random.Random) -> Question:
    element = rng.choice(sorted(ELEMENTS))
    options, letter = _options(rng, ELEMENTS[element], sorted(ELEMENTS.values()))
    return f"What is the chemical symbol of {element}?", options, letter


SUBJECTS: dict[str, Callable[[random.Random], Question]] = {
    "elementary mathematics": _arithmetic,
    "world geography": _capital,
    "units of measurement": _units,
    "high school chemistry": _chemistry,
}


def format_question(question: Question, with_answer: bool) -> str:
    """One MMLU block: the question, lettered options, and `Answer:` (with the letter)."""
    text, options, letter = question
    lines = [text] + [f"{lt}. {opt}" for lt, opt in zip(LETTERS, options)]
    return "\n".join(lines) + ("\nAnswer: " + (letter + "\n\n" if with_answer else ""))


def few_shot_prefix(subject: str, seed: int) -> str:
    """The subject's header and 5 worked examples (the same for every request of the subject)."""
    rng = rng_for(seed, "mmlu-shots", subject)
    header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    shots = (SUBJECTS[subject](rng) for _ in range(NUM_SHOTS))
    return header + "".join(format_question(q, with_answer=True) for q in shots)


@sgl.function
def mmlu(s, few_shot, question):
    # The question block ends in "Answer: " (trailing space) exactly as the shots do, so the
    # letters are scored as the shots wrote them.
    s += few_shot + question
    s += sgl.select("answer", choices=LETTERS)


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` questions, subjects round-robin, each with its subject's 5-shot prefix."""
    subjects = list(SUBJECTS)
    prefixes = {name: few_shot_prefix(name, seed) for name in subjects}
    args = []
    for i in range(num_requests):
        subject = subjects[i % len(subjects)]
        question = SUBJECTS[subject](rng_for(seed, "mmlu-question", i))
        args.append(
            {
                "few_shot": prefixes[subject],
                "question": format_question(question, with_answer=False),
            }
        )
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """The answer is one of the four letters."""
    assert_ok(state)
    state_choice(state, "answer", LETTERS)


WORKLOAD = Workload(
    name="mmlu",
    description="MMLU-style 5-shot multiple choice, select over A-D (4 subjects' prefixes)",
    program=mmlu,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=200,
    quick_num_requests=16,
)
