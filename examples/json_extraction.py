"""JSON extraction with constrained decoding (`regex=`, `json_schema=` and `dtype=` on `gen`).

Pattern: the constraint guarantees parseable output, so no retry loop is needed. Three ways:
- `json_schema=`: the whole object at once, valid under the schema (strings bounded by
  `maxLength`, so a rambling model still closes them);
- `regex=`: the exact shape, field order and separators included;
- field by field: `gen_string` / `gen_int` (`dtype=str` / `int`), each value constrained to
  its type's regex, assembled into JSON in Python.
Every prompt shows one worked example: the constraint fixes the form, the example helps the
(tiny) default model with the content.

Run: python examples/json_extraction.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json

import sglite as sgl

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
CITY_REGEX = r"\{\"name\": \"[A-Za-z ]{1,20}\", \"population\": [0-9]{1,9}\}"

ROME = "Text: Rome, the capital of Italy, has 2800000 inhabitants.\n"
PROMPT = (
    "Extract the city as JSON.\n\n"
    + ROME
    + 'JSON: {{"name": "Rome", "country": "Italy", "population": 2800000}}\n\n'
    + "Text: {text}\nJSON: "
)
FIELDS_PROMPT = (
    "Extract the city's name and population.\n\n"
    + ROME
    + 'name: "Rome"\npopulation: 2800000\n\n'
    + "Text: {text}\n"
)
TEXTS = [
    "Paris, the capital of France, has about 2100000 inhabitants.",
    "Tokyo is the capital of Japan and home to 14000000 people.",
]


@sgl.function
def extract_with_schema(s, text):
    s += PROMPT.format(text=text)
    s += sgl.gen("json", max_tokens=64, json_schema=CITY_SCHEMA)


@sgl.function
def extract_with_regex(s, text):
    s += PROMPT.format(text=text)
    s += sgl.gen("json", max_tokens=48, regex=CITY_REGEX)


@sgl.function
def extract_field_by_field(s, text):
    s += FIELDS_PROMPT.format(text=text)
    s += "name: " + sgl.gen_string("name", max_tokens=16) + "\n"
    # dtype=int stops at a newline or space: a number ends where the model starts a new line.
    s += "population: " + sgl.gen_int("population", max_tokens=12) + "\n"


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    try:
        for program in (extract_with_schema, extract_with_regex):
            states = program.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
            for state in states:
                if state.error() is not None:
                    raise state.error()
                record = json.loads(state["json"])  # valid JSON by construction
                print(f"{program.__name__}: {json.dumps(record)}")
        for text in TEXTS:
            state = extract_field_by_field.run(text=text, backend=backend, temperature=0)
            if state.error() is not None:
                raise state.error()
            record = {"name": json.loads(state["name"]), "population": int(state["population"])}
            print(f"extract_field_by_field: {json.dumps(record)}")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
