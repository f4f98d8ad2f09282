"""JSON extraction with constrained decoding (`regex=` and `json_schema=` on `gen`).

Pattern: the constraint guarantees parseable output, so no retry loop is needed.
NOTE: this needs constrained decoding in the runtime, which sglite does not support yet. The
example catches the runtime's "not supported" error and says so, so it still runs to completion;
once the runtime supports constraints it prints the extracted JSON.

Run: python examples/json_extraction.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json

import sglite as sgl
from sglite.lang.backend.base import is_unsupported_constraint

CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
    "required": ["name", "country"],
}
CITY_REGEX = r"\{\"name\": \"[A-Za-z ]{1,20}\", \"population\": [0-9]{1,9}\}"


@sgl.function
def extract_with_regex(s, text):
    s += "Extract the city as JSON.\nText: " + text + "\nJSON: "
    s += sgl.gen("json", max_tokens=32, regex=CITY_REGEX)


@sgl.function
def extract_with_schema(s, text):
    s += "Extract the city as JSON.\nText: " + text + "\nJSON: "
    s += sgl.gen("json", max_tokens=32, json_schema=json.dumps(CITY_SCHEMA))


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    text = "Paris, the capital of France, has about 2100000 inhabitants."
    for program in (extract_with_regex, extract_with_schema):
        state = program.run(text=text, backend=backend, temperature=0)
        error = state.error()
        if error is None:
            print(f"{program.__name__}: {json.loads(state['json'])}")
        elif is_unsupported_constraint(error):
            print(f"{program.__name__}: skipped, the runtime has no constrained decoding yet")
        else:
            raise error
    backend.shutdown()


if __name__ == "__main__":
    main()
