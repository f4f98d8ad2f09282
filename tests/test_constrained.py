"""Constrained decoding on the real model: every output obeys its constraint, exact jump-forward
changes nothing but the number of forward passes, bad constraints fail cleanly."""

from __future__ import annotations

import collections
import json
import re

import jsonschema
import pytest
import regex as partial_re  # transformers' dependency; can tell a valid prefix of a match

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["baker", "pilot", "teacher"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "employed"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "country": {"const": "France"},
        "location": {
            "type": "object",
            "properties": {
                "latitude": {"type": "integer", "minimum": -90, "maximum": 90},
                "longitude": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["latitude", "longitude"],
            "additionalProperties": False,
        },
        "population_in_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "country", "location"],
    "additionalProperties": False,
}
# SGLang's dtype regexes (sglang/lang/ir.py) and a few of our own.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
REGEX_DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
REGEX_IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
EBNF_ARITH = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [1-9] [0-9]?'
EBNF_ARITH_RE = r"[1-9][0-9]?(\+[1-9][0-9]?)*"


def _check(kind: str, spec, text: str, finished: bool = True) -> None:
    """A finished output is in the constraint's language; one cut by max_new_tokens is a prefix
    of a word of it."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), spec)
        return
    pattern = EBNF_ARITH_RE if kind == "ebnf" else spec
    if finished:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"
    else:
        assert partial_re.fullmatch(pattern, text, partial=True), f"{text!r} vs {pattern!r}"


def _params(kind: str, spec, **extra) -> dict:
    value = json.dumps(spec) if kind == "json_schema" else spec
    # Regexes such as SGLang's dtype ones end in `[ \n]*`: a sampled small model may pad with
    # whitespace up to the limit, which is still a match; keep that short.
    limit = 96 if kind == "json_schema" else 32
    return {kind: value, "max_new_tokens": limit, **extra}


CASES = [
    ("json_schema", PERSON, "Describe a fictional person as JSON."),
    ("json_schema", CITY, "Give the capital of France as JSON."),
    ("regex", REGEX_INT, "How many legs does a spider have?"),
    ("regex", REGEX_FLOAT, "What is pi to three decimals?"),
    ("regex", REGEX_BOOL, "Is the earth round? Answer True or False."),
    ("regex", REGEX_STR, "Name a colour, in quotes."),
    ("regex", REGEX_DATE, "When did the first moon landing happen?"),
    ("regex", REGEX_IPV4, "Give an example IP address."),
    ("ebnf", EBNF_ARITH, "Write a sum of two small numbers."),
]


# Seven constraints (the date and IP regexes run greedily below): 50 samples each is the slow
# part of the suite on 2 cores.
SAMPLED_CASES = [c for c in CASES if c[1] not in (REGEX_DATE, REGEX_IPV4)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,spec,question", SAMPLED_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SAMPLED_CASES)]
)
def test_sampled_outputs_always_obey_the_constraint(engine, kind, spec, question):
    params = [_params(kind, spec, temperature=0.7, seed=1000 + i) for i in range(32)]
    outs = engine.generate([CHAT.format(question)] * 32, params)
    for out in outs:
        finished = out["meta_info"]["finish_reason"]["type"] == "stop"
        if kind == "json_schema":  # a truncated object would not parse: it must have finished
            assert finished, out
        _check(kind, spec, out["text"], finished)


GREEDY_CASES = CASES + [
    ("regex", r"(yes|no)", "Is water wet?"),
    ("regex", r"The answer is (yes|no|maybe)\.", "Will it rain tomorrow?"),
    ("regex", r"[A-Z][a-z]+ is the capital of [A-Z][a-z]+\.", "Capital of Italy?"),
    ("regex", r"\{\"first_name\": \"[A-Za-z]+\", \"last_name\": \"[A-Za-z]+\"\}", "A name."),
    ("regex", r"Step 1: [a-z ]{1,30}\nStep 2: [a-z ]{1,30}", "How to boil an egg?"),
    ("regex", r"(red|green|blue), (red|green|blue)", "Two colours."),
    ("json_schema", {"type": "array", "items": {"type": "integer"}, "maxItems": 4}, "Numbers."),
    ("json_schema", {"type": "object"}, "Any JSON object about dogs."),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {
                "temperature_celsius": {"type": "number", "minimum": -50, "maximum": 60}
            },
            "required": ["temperature_celsius"],
            "additionalProperties": False,
        },
        "Today's temperature in Paris as JSON.",
    ),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["title"],
        },
        "A famous book as JSON.",
    ),
    ("ebnf", 'root ::= "Answer: " ("A" | "B" | "C" | "D")', "Pick a letter."),
    ("ebnf", 'root ::= "[" item (", " item)* "]"\nitem ::= [a-z]+', "List fruits."),
]


def test_greedy_outputs_identical_with_and_without_jump_forward(engine, engine_no_jump_forward):
    assert len(GREEDY_CASES) >= 20
    prompts = [CHAT.format(q) for _, _, q in GREEDY_CASES]
    params = [_params(k, s, temperature=0) for k, s, _ in GREEDY_CASES]
    with_jf = engine.generate(prompts, params)
    without = engine_no_jump_forward.generate(prompts, params)
    for (kind, spec, _), a, b in zip(GREEDY_CASES, with_jf, without, strict=True):
        assert a["output_ids"] == b["output_ids"], (kind, spec, a["text"], b["text"])
        assert b["meta_info"]["jump_forward_drafted_tokens"] == 0
    assert sum(o["meta_info"]["jump_forward_accepted_tokens"] for o in with_jf) > 50


def test_jump_forward_needs_fewer_forward_passes(engine, engine_no_jump_forward):
    schema = {
        "type": "object",
        "properties": {
            "the_full_name_of_the_character": {"type": "string", "maxLength": 12},
            "the_age_of_the_character_in_years": {"type": "integer"},
            "the_home_town_of_the_character": {"type": "string", "maxLength": 12},
        },
        "required": [
            "the_full_name_of_the_character",
            "the_age_of_the_character_in_years",
            "the_home_town_of_the_character",
        ],
        "additionalProperties": False,
    }
    prompt = CHAT.format("Describe a character as JSON.")
    params = _params("json_schema", schema, temperature=0)
    passes = {}
    outs = {}
    for name, eng in (("on", engine), ("off", engine_no_jump_forward)):
        before = eng.get_server_info()["forward_passes"]
        outs[name] = eng.generate(prompt, params)
        passes[name] = eng.get_server_info()["forward_passes"] - before
    assert outs["on"]["text"] == outs["off"]["text"]
    jsonschema.validate(json.loads(outs["on"]["text"]), schema)
    meta = outs["on"]["meta_info"]
    assert meta["jump_forward_accepted_tokens"] >= 20, meta
    assert passes["off"] == meta["completion_tokens"]  # one prefill + one decode per token - 1
    # Each accepted draft token saves a pass, except one that ends the request (no bonus token).
    assert passes["on"] <= passes["off"] - meta["jump_forward_accepted_tokens"] + 1
    assert passes["on"] < 0.6 * passes["off"], passes


def test_seeded_sampling_distribution_unchanged_by_jump_forward(engine, engine_no_jump_forward):
    # Sampled requests with drafts: the answers must be distributed exactly as without
    # jump-forward. (llguidance's mask allows only the canonical tokens of forced text, so its
    # drafts are never rejected; xgrammar's allows other tokenizations too.)
    n = 60
    prompt = CHAT.format("What do you think about cats?")
    regex = r"I think cats are (great|fine|awful)\."
    params = [
        {"regex": regex, "max_new_tokens": 20, "temperature": 1.5, "seed": s} for s in range(n)
    ]
    with_jf = engine.generate([prompt] * n, params)
    without = engine_no_jump_forward.generate([prompt] * n, params)
    drafted = sum(o["meta_info"]["jump_forward_drafted_tokens"] for o in with_jf)
    accepted = sum(o["meta_info"]["jump_forward_accepted_tokens"] for o in with_jf)
    assert 0 < accepted <= drafted
    a = collections.Counter(o["text"] for o in with_jf)
    b = collections.Counter(o["text"] for o in without)
    assert len(b) >= 2  # the sample really varies
    distance = sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / (2 * n)
    assert distance <= 0.15, (a, b)
    # The same seed draws the same uniforms per emitted token, so most are identical outright.
    same = sum(x["output_ids"] == y["output_ids"] for x, y in zip(with_jf, without))
    assert same >= 0.9 * n
    for o in with_jf:
        assert re.fullmatch(regex, o["text"])


def test_constrained_and_free_requests_share_a_batch(engine):
    free_prompt = CHAT.format("Say something about the sea.")
    free = {"max_new_tokens": 24, "temperature": 0}
    alone = engine.generate(free_prompt, free)
    prompts = [free_prompt, CHAT.format("Describe a fictional person as JSON."), free_prompt]
    params = [free, _params("json_schema", PERSON, temperature=0), {**free, "max_new_tokens": 10}]
    outs = engine.generate(prompts, params)
    assert outs[0]["output_ids"] == alone["output_ids"]
    assert outs[2]["output_ids"] == alone["output_ids"][:10]
    jsonschema.validate(json.loads(outs[1]["text"]), PERSON)


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"regex": "([a-z"}, "regex"),
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"regex": "a", "json_schema": "{}"}, "at most one"),
    ],
)
def test_invalid_constraints_raise_and_the_engine_keeps_serving(engine, params, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate("Hello", {**params, "max_new_tokens": 4})
    out = engine.generate("Hello", {"regex": "[0-9]{3}", "max_new_tokens": 8, "temperature": 0})
    assert re.fullmatch("[0-9]{3}", out["text"])


def test_unfinishable_constraint_ends_with_length_and_partial_text(engine):
    params = _params("json_schema", PERSON, temperature=0)
    params["max_new_tokens"] = 6
    out = engine.generate(CHAT.format("Describe a fictional person as JSON."), params)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 6
    assert out["text"].startswith('{"name": "')


def test_streamed_constrained_output_matches_the_whole(engine):
    params = _params("json_schema", CITY, temperature=0)
    prompt = CHAT.format("Give the capital of France as JSON.")
    whole = engine.generate(prompt, params)["text"]
    pieces = [chunk["text"] for chunk in engine.generate(prompt, params, stream=True)]
    assert pieces[-1] == whole  # the Engine streams the cumulative text
    assert all(b.startswith(a) for a, b in zip(pieces, pieces[1:], strict=False))
    jsonschema.validate(json.loads(whole), CITY)


def test_retokenize_mode_is_valid_but_unverified(engine_retokenize):
    prompts = [CHAT.format(q) for _, _, q in CASES]
    params = [_params(k, s, temperature=0) for k, s, _ in CASES]
    outs = engine_retokenize.generate(prompts, params)
    for (kind, spec, _), out in zip(CASES, outs, strict=True):
        _check(kind, spec, out["text"])
        meta = out["meta_info"]
        assert meta["jump_forward_accepted_tokens"] == meta["jump_forward_drafted_tokens"]
    assert sum(o["meta_info"]["jump_forward_accepted_tokens"] for o in outs) > 30
