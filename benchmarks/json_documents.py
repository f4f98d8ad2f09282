"""The JSON benchmark's documents: synthetic, deterministic paragraphs about invented cities
and characters (with distractor names and numbers), their true facts, the chat prompts with one
worked example, and the sampling-parameter entry for each constraint variant."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from benchmarks.json_constraints import CHARACTER, CITY, Kind

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


SYL_A = "Val Kes Bran Mor Tal Esk Dun Ar Sel Qua Vor Lin Cal Ost Hal Mir Thal Gren Pel Rav".split()
SYL_B = "do tre wi ma ro ve li sa ne ka ba thi go de ru la".split()
SYL_C = "ria moor ford ton mark burg heim vale port stead wick grad lund sk".split()
COUNTRIES = (
    "Veloria Castavia Nordmark Eskaland Marovia Tessaria Duvania Orlinth Sarnova Kelvaria "
    "Brisland Amerath"
).split()
FIRST = (
    "Anna Boris Clara Dmitri Elena Felix Greta Hugo Irene Jonas Katya Leon Mara Nils Olga Pavel "
    "Rosa Stefan Tilda Viktor"
).split()
LAST = (
    "Albrecht Brandt Castell Dorn Eklund Falk Gruber Hartmann Ivanov Jansen Keller Lindqvist "
    "Moreau Novak Ortega Petrov Quist Rasmussen Sandoval Thorne"
).split()
RIVERS = "Amber Silver Oster Vell Karn Dune Mirel Tarn".split()
INDUSTRIES = "shipbuilding, textiles, glassmaking, printing, clockmaking, wine, timber".split(", ")
ORIGINS = ["fishing village", "river crossing", "trading post", "monastery", "mining camp"]
ISSUES = ["public transport", "housing", "clean water", "the old harbour", "school buildings"]
OCCUPATIONS = (
    "baker, pilot, teacher, carpenter, astronomer, librarian, nurse, fisherman, architect, "
    "painter, blacksmith, pharmacist"
).split(", ")
HOBBIES = (
    "chess, gardening, rock climbing, painting, sailing, birdwatching, pottery, cycling, "
    "knitting, fencing, beekeeping, archery"
).split(", ")
TRAITS = ["patient", "stubborn", "cheerful", "curious", "quiet", "generous"]


def article(noun: str) -> str:
    """The noun with 'a' or 'an' (by spelling: eight-year-old, eighteen...)."""
    an = noun[0] in "aeiou" or noun.startswith(("8", "11", "18"))
    return ("an " if an else "a ") + noun


def invent_place(rng: random.Random) -> str:
    """An invented place name."""
    return rng.choice(SYL_A) + rng.choice(SYL_B) + rng.choice(SYL_C)


def invent_person(rng: random.Random) -> str:
    """An invented full name."""
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def city_document(rng: random.Random) -> tuple[str, dict]:
    """An encyclopedia-style paragraph about an invented city, and its true facts."""
    name, country, mayor = invent_place(rng), rng.choice(COUNTRIES), invent_person(rng)
    pop, year = rng.randint(5_000, 5_000_000), rng.randint(800, 1950)
    other, other_pop = invent_place(rng), rng.randint(1_000, 90_000)
    first = rng.choice(
        [
            f"{name} is a city in {country}, on the banks of the {rng.choice(RIVERS)} river.",
            f"{name} is the largest city of the {rng.choice(RIVERS)} valley in {country}.",
            f"Located in the north of {country}, {name} is an old city on the coast.",
        ]
    )
    facts = [
        f"It was founded in {year} as a {rng.choice(ORIGINS)} and grew rich from "
        f"{rng.choice(INDUSTRIES)}.",
        f"The latest census counted {pop} inhabitants in the city proper.",
        f"The current mayor is {mayor}, elected after a campaign about {rng.choice(ISSUES)}.",
    ]
    filler = [
        f"The nearby town of {other} has about {other_pop} inhabitants.",
        f"Every summer {name} hosts a festival of {rng.choice(INDUSTRIES)}.",
        f"It is twinned with {invent_place(rng)} in {rng.choice(COUNTRIES)}.",
        f"The former mayor, {invent_person(rng)}, now teaches history at the university.",
    ]
    rng.shuffle(facts)
    body = facts + rng.sample(filler, 2)
    rng.shuffle(body)
    truth = {
        "name_of_the_city": name,
        "country_the_city_is_in": country,
        "population_of_the_city": pop,
        "year_the_city_was_founded": year,
        "name_of_the_current_mayor": mayor,
    }
    return " ".join([first] + body), truth


def character_document(rng: random.Random) -> tuple[str, dict]:
    """A short profile of an invented character, and its true facts."""
    name, age = invent_person(rng), rng.randint(18, 90)
    given = name.split()[0]
    occupation, hometown, hobby = rng.choice(OCCUPATIONS), invent_place(rng), rng.choice(HOBBIES)
    first = rng.choice(
        [
            f"{name} is {article(f'{age}-year-old')} {occupation} from {hometown}.",
            f"{name}, aged {age}, works as {article(occupation)} and was born in {hometown}.",
            f"Born and raised in {hometown}, {name} is {age} years old and {article(occupation)}.",
        ]
    )
    facts = [
        f"In the evenings {given} is passionate about {hobby}.",
        f"Friends describe {given} as {rng.choice(TRAITS)} and reliable.",
    ]
    filler = [
        f"{given}'s cousin {rng.choice(FIRST)} is {article(rng.choice(OCCUPATIONS))} in "
        f"{invent_place(rng)}.",
        f"{given} once spent a year travelling through {rng.choice(COUNTRIES)}.",
        f"At {rng.randint(20, 40)}, {given} briefly tried {rng.choice(HOBBIES)} but gave it up.",
        f"{given}'s neighbour, {invent_person(rng)}, is {rng.randint(18, 90)} years old.",
    ]
    body = facts + rng.sample(filler, 2)
    rng.shuffle(body)
    truth = {
        "full_name_of_the_character": name,
        "age_of_the_character_in_years": age,
        "occupation_of_the_character": occupation,
        "hometown_of_the_character": hometown,
        "favourite_hobby_of_the_character": hobby,
    }
    return " ".join([first] + body), truth


@dataclass
class Doc:
    """One benchmark document with its prompt."""

    kind: Kind
    text: str
    truth: dict
    prompt: str = ""


def make_prompt(kind: Kind, text: str, example: tuple[str, dict]) -> str:
    """A chat turn: the task, one worked example, then the document."""
    keys = ", ".join(f.key for f in kind.fields)
    task = (
        f"Extract the facts about the {kind.name} in the document as a JSON object with the "
        f"keys {keys}.\n\n"
        f"Document: {example[0]}\nJSON: {json.dumps(example[1])}\n\n"
        f"Document: {text}\nJSON:"
    )
    return CHAT.format(task)


def make_docs(n: int, seed: int) -> list[Doc]:
    """n documents, cities and characters alternating, deterministic in `seed`."""
    examples = {
        "city": city_document(random.Random(f"{seed}-example-city")),
        "character": character_document(random.Random(f"{seed}-example-character")),
    }
    docs = []
    for i in range(n):
        rng = random.Random(f"{seed}-{i}")
        kind = CITY if i % 2 == 0 else CHARACTER
        text, truth = (city_document if kind is CITY else character_document)(rng)
        docs.append(Doc(kind, text, truth, make_prompt(kind, text, examples[kind.name])))
    return docs


def constraint_params(doc: Doc, variant: str) -> dict:
    """The sampling-parameter entry for a document's constraint (none for 'free')."""
    if variant == "schema":
        return {"json_schema": json.dumps(doc.kind.schema())}
    if variant == "regex":
        return {"regex": doc.kind.regex()}
    return {}
