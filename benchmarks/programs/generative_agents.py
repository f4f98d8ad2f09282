"""Generative-agents memory prompts (the paper's Generative Agents workload).

Models: Park et al.'s generative agents, whose LLM calls put an agent's profile and memory
stream in front of a short query: rate an event's importance, reflect on recent memories, plan
the next day, or decide how to react to an observation. Each call is one short generation
(plus a yes/no `select` for reactions and a constrained 1-10 rating for importance).

Data: synthesised agents (name, age, job, traits) with a timestamped memory stream of about 40
everyday observations built from templates. No download.

Sharing: each agent's profile + memory stream (about 950 tokens) is shared by every request
about that agent; consecutive requests ask that agent's four kinds of query in turn, then move
to the next agent, so requests form groups of four around one long prefix. A short
instruction shared by all agents comes first.
"""

from __future__ import annotations

from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, greedy_gen, rng_for, state_choice, state_str

NUM_MEMORIES = 40
KINDS = ["importance", "reflection", "planning", "reaction"]
YES_NO = [" yes", " no"]

AGENTS = [
    ("Isabella Rodriguez", 34, "runs a cafe", "friendly, organised, loves hosting events"),
    ("Klaus Mueller", 21, "is a sociology student", "curious, shy, writes a lot"),
    ("Maria Lopez", 28, "is a physics PhD student", "ambitious, plays video games to relax"),
    ("Tom Moreno", 45, "owns a grocery store", "practical, talkative, worries about money"),
    ("Ayesha Khan", 30, "is a journalist", "sharp, sceptical, always asks questions"),
]
PLACES = ["the cafe", "the park", "the library", "the grocery store", "home", "the college",
          "the town square", "the bakery"]  # fmt: skip
ACTIONS = ["had coffee with {o}", "read a book about local history", "cleaned the kitchen",
           "talked with {o} about the upcoming election", "went for a walk",
           "wrote in a journal", "helped {o} carry boxes", "cooked pasta for dinner",
           "argued with {o} about the rent", "planned a party with {o}",
           "listened to music", "fixed a broken chair", "watered the plants",
           "saw {o} looking upset", "bought fresh bread"]  # fmt: skip
OTHERS = ["Sam Moore", "Jennifer Lee", "Carlos Gomez", "Hailey Johnson", "Eddy Lin"]
OBSERVATIONS = ["{o} is crying on a bench", "{o} is painting a mural", "the stove is on fire",
                "{o} waves from across the street", "a new shop opened next door"]  # fmt: skip

INSTRUCTION = "You simulate a person in a small town. Answer as the person would, briefly.\n\n"


def memory_stream(agent: int, seed: int) -> str:
    """The agent's profile and timestamped memories (identical for every query about them)."""
    name, age, job, traits = AGENTS[agent]
    rng = rng_for(seed, "agent-memories", agent)
    lines = [f"Name: {name} (age: {age})", f"{name} {job}. Traits: {traits}.", "Memories:"]
    for m in range(NUM_MEMORIES):
        day, hour, minute = 1 + m // 10, 7 + m % 10, rng.choice([0, 15, 30, 45])
        action = rng.choice(ACTIONS).format(o=rng.choice(OTHERS))
        lines.append(f"[Day {day} {hour:02d}:{minute:02d}] At {rng.choice(PLACES)}, {action}.")
    return "\n".join(lines) + "\n\n"


def _query(kind: str, name: str, rng: Any) -> str:
    """The kind's question about the agent."""
    if kind == "importance":
        event = rng.choice(ACTIONS).format(o=rng.choice(OTHERS))
        return (
            f"On a scale of 1 to 10, where 1 is mundane and 10 is extremely poignant, rate "
            f"the event: {name} {event}.\nRating: "
        )
    if kind == "reflection":
        return f"What is one high-level insight {name} can infer from the memories above?\n"
    if kind == "planning":
        return f"Today is Day 5. Write {name}'s plan for the morning in one sentence.\n"
    observation = rng.choice(OBSERVATIONS).format(o=rng.choice(OTHERS))
    return f"Observation: {observation}.\nShould {name} react to the observation?"


@sgl.function
def generative_agents(s, memories, kind, query):
    s += INSTRUCTION + memories + query
    if kind == "importance":
        s += greedy_gen("rating", 4, regex=r"(10|[1-9])")
    elif kind == "reaction":
        s += sgl.select("react", choices=YES_NO) + ". Reaction:"
        s += greedy_gen("response", 24, min_tokens=2, stop="\n\n")
    else:  # at least a word (a small model may end at once), up to a blank line
        s += "Answer:" + greedy_gen("response", 32, min_tokens=2, stop="\n\n")


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """Requests in groups of the four query kinds, one group per agent (agents cycle)."""
    streams: dict[int, str] = {}
    args = []
    for i in range(num_requests):
        agent, kind = (i // len(KINDS)) % len(AGENTS), KINDS[i % len(KINDS)]
        if agent not in streams:
            streams[agent] = memory_stream(agent, seed)
        query = _query(kind, AGENTS[agent][0], rng_for(seed, "agent-query", i))
        args.append({"memories": streams[agent], "kind": kind, "query": query})
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """Importance: a rating 1-10; reaction: yes/no and a response; else a response."""
    assert_ok(state)
    kind = args["kind"]
    if kind == "importance":
        rating = state_str(state, "rating")
        assert rating.isdigit() and 1 <= int(rating) <= 10, f"'rating': {rating!r} not in 1-10"
        return
    if kind == "reaction":
        state_choice(state, "react", YES_NO)
    state_str(state, "response")


WORKLOAD = Workload(
    name="generative_agents",
    description="generative agents: importance/reflection/planning/reaction over a memory stream",
    program=generative_agents,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=200,
    quick_num_requests=16,
)
