"""Constrained `gen` in the language, on the real model, through both native backends.

`regex=`, `json_schema=` (dict or string), `dtype=` (int, float, str, bool), `gen_int` and
`gen_string` must reach the runtime from the in-process `EngineBackend` and from
`RuntimeEndpoint` over HTTP, and the outputs must match SGLang's dtype regexes. Prompts are
chosen so the unconstrained greedy answer would not match (a leading space, a capital letter),
so a match shows the constraint was applied. Greedy and a few tokens, as elsewhere.
"""

from __future__ import annotations

import json
import re
import warnings

import jsonschema
import pytest

import sglite as sgl
from sglite.lang.sampling_params import REGEX_BOOL, REGEX_STR

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
FACT = "Paris has about 2100000 inhabitants."


def run(program, backend, **kwargs):
    """Run greedily; fail on a program error or the warning of a dropped dtype constraint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*constrained decoding")
        state = program.run(backend=backend, temperature=0, **kwargs)
        state.sync()
    assert state.error() is None, state.error()
    return state


def test_gen_regex(backend, engine):
    @sgl.function
    def prog(s):
        s += "Q: Is the sky blue? Answer yes or no.\nA:"
        s += sgl.gen("answer", max_tokens=4, regex=r"(yes|no)")
        s += "\nQ: The date of the first moon landing (YYYY-MM-DD)?\nA:"
        s += sgl.gen("date", max_tokens=12, regex=r" [0-9]{4}-[0-9]{2}-[0-9]{2}")

    state = run(prog, backend)
    assert re.fullmatch(r"(yes|no)", state["answer"]), state["answer"]
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", state["date"]), state["date"]
    # The same request straight to the Engine gives the same text (the frontend adds nothing).
    prefix = "Q: Is the sky blue? Answer yes or no.\nA:"
    direct = engine.generate(prefix, {"temperature": 0, "max_new_tokens": 4, "regex": r"(yes|no)"})
    assert state["answer"] == direct["text"]


@pytest.mark.parametrize("as_string", [False, True], ids=["dict", "string"])
def test_gen_json_schema(backend, as_string):
    schema = json.dumps(SCHEMA) if as_string else SCHEMA

    @sgl.function
    def prog(s):
        s += f"{FACT}\nThe city and its population as JSON: "
        s += sgl.gen("json", max_tokens=32, json_schema=schema)

    state = run(prog, backend)
    jsonschema.validate(json.loads(state["json"]), SCHEMA)


@pytest.mark.parametrize(
    ("dtype", "question", "pattern"),
    [
        # dtype's stop strings (space, newline) cut the blanks REGEX_INT / REGEX_FLOAT allow.
        (int, "How many legs does a spider have?", r"[-+]?[0-9]+"),
        (float, "What is the value of pi?", r"[-+]?[0-9]*\.?[0-9]+"),
        (bool, "Is Paris in France?", REGEX_BOOL),
        (str, "What is the capital of Italy? Answer in double quotes.", REGEX_STR),
    ],
    ids=["int", "float", "bool", "str"],
)
def test_gen_dtype(backend, dtype, question, pattern):
    @sgl.function
    def prog(s):
        s += f"Q: {question}\nA: "
        s += sgl.gen("value", max_tokens=12, dtype=dtype)

    state = run(prog, backend)
    value = state["value"]
    meta = state.get_meta_info("value")
    if dtype is str and meta["finish_reason"]["type"] == "length":
        # A string the model did not close within max_tokens: a prefix of the regex's language.
        assert re.fullmatch(r"\"[\w\d\s]*", value), value
    else:
        assert re.fullmatch(pattern, value), value


def test_gen_int_and_gen_string(backend):
    @sgl.function
    def prog(s):
        s += FACT + "\n"
        s += 'The record: {"city": '
        s += sgl.gen_string("city", max_tokens=8)
        s += ', "population": '
        s += sgl.gen_int("population", max_tokens=10)
        s += "}"

    state = run(prog, backend)
    assert re.fullmatch(REGEX_STR, state["city"]), state["city"]
    assert re.fullmatch(r"[-+]?[0-9]+", state["population"]), state["population"]
    record = json.loads(state.text().split("The record: ", 1)[1])
    assert record == {"city": json.loads(state["city"]), "population": int(state["population"])}


def test_streamed_constrained_gen(backend):
    @sgl.function
    def prog(s):
        s += "Q: Is water wet? Answer yes or no.\nA:"
        s += sgl.gen("answer", max_tokens=4, regex=r"(yes|no)")

    normal = run(prog, backend)
    streamed = prog.run(backend=backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter("answer")) == normal["answer"]


def test_constraint_errors():
    # Malformed constraints fail at the line that writes them, with the parser's message.
    with pytest.raises(ValueError, match="unclosed"):
        sgl.gen("a", regex="[unclosed")
    with pytest.raises(ValueError, match="json_schema"):
        sgl.gen("a", json_schema="{not json")
    with pytest.raises(ValueError, match="objec"):
        sgl.gen("a", json_schema={"type": "objec"})
    # The runtime's regex syntax, not Python's: \p{L} is a valid (Unicode letter) class there.
    gen = sgl.gen("a", regex=r"\p{L}+")
    assert gen.sampling_params.regex == r"\p{L}+"
    assert json.loads(sgl.gen("b", json_schema=SCHEMA).sampling_params.json_schema) == SCHEMA


def test_runtime_refusal_surfaces_as_the_program_error(backend):
    @sgl.function
    def prog(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2, regex="a", json_schema={"type": "object"})

    state = prog.run(backend=backend)
    assert "at most one" in str(state.error())
    with pytest.raises(RuntimeError, match="was not produced"):
        state["x"]
