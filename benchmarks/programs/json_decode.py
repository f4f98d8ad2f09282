"""JSON decoding with regex and JSON-schema constraints (the paper's JSON decoding workload).

Models: SGLang's JSON-decoding benchmark: extract facts about a city from an encyclopedia-like
page into JSON. Two constrained generations per request: the city record under a `regex` that
fixes field order and separators (where jump-forward decoding skips the constant parts), then
a second object under a `json_schema` (enum, boolean, bounded integer, string).

Data: synthesised pages about fictional cities from templates. No download.

Sharing: the instruction and one worked example (about 120 tokens) are shared by all
requests; within a request the page (about 75 tokens) is the prefix of both constrained
generations.

Every field is bounded, so the worst case (one token per character) fits in `max_tokens`: the
output always parses.
"""

from __future__ import annotations

import json
import re
from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, greedy_gen, rng_for, state_json, state_str

# name and country: up to 16 characters each, population up to 8 digits; with the constant
# parts (about 15 tokens) at most 55 tokens.
CITY_REGEX = (
    r'\{"name": "[A-Za-z ]{1,16}", "country": "[A-Za-z ]{1,16}", "population": [0-9]{1,8}\}'
)
CONTINENTS = ["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]
FACTS_SCHEMA = {
    "type": "object",
    "properties": {
        "continent": {"type": "string", "enum": CONTINENTS},
        "is_capital": {"type": "boolean"},
        "founded": {"type": "integer", "minimum": 0, "maximum": 2100},
        "river": {"type": "string", "maxLength": 12},
    },
    "required": ["continent", "is_capital", "founded", "river"],
    "additionalProperties": False,
}

INSTRUCTION = """Extract information about the city described on each page as JSON.

Page: Velmora is the capital of Arcadia, a country in Europe. Founded in 1204 on the banks of \
the river Sella, it has 1250000 inhabitants.
City: {"name": "Velmora", "country": "Arcadia", "population": 1250000}
Facts: {"continent": "Europe", "is_capital": true, "founded": 1204, "river": "Sella"}

"""
SYLLABLES = ["al", "ber", "cor", "dan", "el", "fen", "gar", "hol", "is", "kor", "lun", "mar",
             "nor", "os", "pel", "ran", "sol", "tor", "val", "wen"]  # fmt: skip
FEATURES = ["an old cathedral", "a busy harbour", "a famous university", "a large market square",
            "a medieval castle", "a botanical garden", "a railway museum"]  # fmt: skip


def _name(rng: Any, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def _page(rng: Any) -> str:
    """A short encyclopedia-style page about a fictional city."""
    city, country, river = _name(rng, 3), _name(rng, 2) + "ia", _name(rng, 2)
    continent, founded = rng.choice(CONTINENTS), rng.randint(800, 1950)
    population = rng.randint(20, 9000) * 1000
    role = "the capital" if rng.random() < 0.4 else "a regional city"
    features = ", ".join(rng.sample(FEATURES, 2))
    return (
        f"{city} is {role} of {country}, a country in {continent}. Founded in {founded} on the "
        f"banks of the river {river}, it has {population} inhabitants. The city is known for "
        f"{features}. Its climate is mild, and tourism and trade are its main industries."
    )


@sgl.function
def json_decode(s, page):
    s += INSTRUCTION + "Page: " + page + "\nCity: "
    s += greedy_gen("city", 64, regex=CITY_REGEX)
    s += "\nFacts: " + greedy_gen("facts", 64, json_schema=FACTS_SCHEMA)


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` pages about fictional cities."""
    return [{"page": _page(rng_for(seed, "json", i))} for i in range(num_requests)]


def check(state: Any, args: dict[str, Any]) -> None:
    """`city` matches the regex and parses; `facts` parses and has the schema's shape."""
    assert_ok(state)
    city_text = state_str(state, "city")
    assert re.fullmatch(CITY_REGEX, city_text), f"'city' does not match the regex: {city_text!r}"
    city = state_json(state, "city")
    assert set(city) == {"name", "country", "population"}, f"'city' keys: {sorted(city)}"
    facts = state_json(state, "facts")
    assert isinstance(facts, dict), f"'facts' is not an object: {facts!r}"
    assert set(facts) == set(FACTS_SCHEMA["required"]), f"'facts' keys: {sorted(facts)}"
    assert facts["continent"] in CONTINENTS, f"'facts.continent': {facts['continent']!r}"
    assert isinstance(facts["is_capital"], bool), "'facts.is_capital' is not a boolean"
    assert isinstance(facts["founded"], int), "'facts.founded' is not an integer"
    assert 0 <= facts["founded"] <= 2100, "'facts.founded' is out of range"
    assert isinstance(facts["river"], str), "'facts.river' is not a string"


def _self_check() -> None:
    """The worked example in the instruction satisfies both constraints (import-time guard)."""
    example = INSTRUCTION.split("City: ")[1].split("\n")[0]
    assert re.fullmatch(CITY_REGEX, example), example
    facts = json.loads(INSTRUCTION.split("Facts: ")[1].split("\n")[0])
    assert set(facts) == set(FACTS_SCHEMA["required"]), facts


_self_check()

WORKLOAD = Workload(
    name="json_decode",
    description="JSON decoding: a regex-constrained record and a json_schema-constrained object",
    program=json_decode,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=100,
    quick_num_requests=8,
)
