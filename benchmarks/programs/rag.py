"""Retrieval-augmented generation, DSPy-style two steps (the paper's RAG workload).

Models: a DSPy multi-hop pipeline (SimplifiedBaleen-like): retrieved passages and a question,
then step 1 `gen`s a search query for a second hop, the second-hop passage is appended (the
retriever's answer, constant text), and step 2 reasons (`gen`, chain of thought) and answers
(`gen`).

Data: a synthesised corpus about fictional companies (founder, city, year, product, staff,
...); the "retriever" returns a company's 4 passages for every question about it, and the
second-hop passage restates the asked fact. No download.

Sharing: an instruction shared by all requests, then the retrieved passages (about 135 tokens),
shared by the 4 consecutive requests asking about the same company (a group); within a request
step 2 extends step 1's prompt and output.
"""

from __future__ import annotations

from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, greedy_gen, rng_for, state_str

GROUP_SIZE = 4  # questions asked about the same retrieved passages

INSTRUCTION = """Answer questions using the retrieved passages. First write a search query for \
any missing information, then reason step by step, then give a short factual answer.

Passages:
[1] Brightline is a maker of desk lamps based in Oslo.
[2] Brightline was founded in 1998 by Eva Lund.
Question: Who founded Brightline?
Search query: founder of Brightline
Retrieved: Eva Lund founded Brightline in 1998 in Oslo.
Reasoning: Let's think step by step. Passage 2 says that Brightline was founded by Eva Lund.
Answer: Eva Lund

"""
PREFIXES = ["Nor", "Vel", "Quin", "Ast", "Bel", "Cor", "Dra", "Hal", "Mer", "Tal", "Zen"]
SUFFIXES = ["tek", "ora", "ix", "wave", "field", "forge", "line", "spark"]
PEOPLE = ["Ada Brenner", "Oren Castell", "Lina Okafor", "Marek Nowak", "Sofia Reyes",
          "Kenji Mori", "Ruth Adler", "Tariq Haddad"]  # fmt: skip
CITIES = ["Lyon", "Porto", "Tampere", "Graz", "Utrecht", "Bergen", "Leeds", "Brno"]
PRODUCTS = ["solar roof tiles", "electric bicycles", "water filters", "farm drones",
            "hearing aids", "modular kitchens", "wind sensors", "bike locks"]  # fmt: skip


def company_facts(seed: int, group: int) -> dict[str, Any]:
    """The facts of one fictional company (one retrieval group)."""
    rng = rng_for(seed, "rag-company", group)
    return {
        "name": rng.choice(PREFIXES) + rng.choice(SUFFIXES),
        "founder": rng.choice(PEOPLE),
        "city": rng.choice(CITIES),
        "year": rng.randint(1950, 2015),
        "product": rng.choice(PRODUCTS),
        "staff": rng.randint(3, 90) * 100,
        "ceo": rng.choice(PEOPLE),
    }


def company_passages(c: dict[str, Any]) -> str:
    """The 4 retrieved passages about company `c`, numbered."""
    passages = [
        f"{c['name']} is a manufacturer of {c['product']} headquartered in {c['city']}. The "
        f"company sells mainly to small businesses and has offices in three countries.",
        f"{c['name']} was founded in {c['year']} by {c['founder']}, who had previously worked "
        f"as an engineer. The first factory opened two years after the founding.",
        f"Today {c['name']} employs about {c['staff']} people. Its chief executive is "
        f"{c['ceo']}, who joined the company as a sales manager.",
        f"In recent years {c['name']} has invested in research on cheaper {c['product']} and "
        f"has won several design awards for its products.",
    ]
    return "".join(f"[{i}] {p}\n" for i, p in enumerate(passages, start=1))


# (question, second-hop passage) templates about one fact each
QUESTIONS = [
    ("Who founded {name}?", "{founder} founded {name} in {year} in {city}."),
    ("In which city is {name} headquartered?", "The headquarters of {name} are in {city}."),
    ("When was {name} founded?", "{name} was established in the year {year}."),
    ("What does {name} make?", "{name} is best known for its {product}."),
    ("How many people work at {name}?", "{name} has a workforce of about {staff}."),
    ("Who is the chief executive of {name}?", "{ceo} has led {name} as chief executive."),
]


@sgl.function
def rag(s, passages, question, second_hop):
    s += INSTRUCTION + "Passages:\n" + passages + "Question: " + question + "\n"
    s += "Search query:" + greedy_gen("search_query", 16, stop="\n")
    s += "\nRetrieved: " + second_hop + "\n"
    s += "Reasoning: Let's think step by step." + greedy_gen("rationale", 32, stop="\n")
    s += "\nAnswer:" + greedy_gen("answer", 16, stop="\n")


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """Requests in groups of GROUP_SIZE questions about one company's passages."""
    args = []
    for i in range(num_requests):
        company = company_facts(seed, i // GROUP_SIZE)
        rng = rng_for(seed, "rag-question", i)
        question, second_hop = rng.choice(QUESTIONS)
        args.append(
            {
                "passages": company_passages(company),
                "question": question.format(**company),
                "second_hop": second_hop.format(**company),
            }
        )
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """A search query, a rationale and an answer, all strings."""
    assert_ok(state)
    for name in ("search_query", "rationale", "answer"):
        state_str(state, name)


WORKLOAD = Workload(
    name="rag",
    description="RAG, DSPy-style: passages + question -> search query (gen), reasoning + answer",
    program=rag,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=128,
    quick_num_requests=8,
)
