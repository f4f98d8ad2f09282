"""API speculative execution: a six-field character profile in one API call instead of six.

Pattern: `sgl.OpenAI(model, base_url=...)` runs programs on any OpenAI-compatible endpoint;
`@sgl.function(num_api_spec_tokens=N)` lets one call generate past the first field, and the
following fields are cut out of that text while the program's constant text ("\\nAge:", ...)
matches what the model wrote. As a chat model, the whole assistant turn is one call. The same
program without speculation runs for comparison: same values (greedy), more calls and prompt
tokens (`backend.token_usage`).

Run: python examples/openai_speculative.py [--url http://127.0.0.1:30000]
(the server's OpenAI API is `--url` + `/v1`; without `--url` a server is started here)
"""

from __future__ import annotations

import argparse

import sglite as sgl

FIELDS = ["name", "age", "job", "hobby", "city", "pet"]
EXAMPLE = "Name: Alice Smith\nAge: 34\nJob: teacher\nHobby: painting\nCity: Boston\nPet: cat"


def profile_program(num_api_spec_tokens: int | None):
    @sgl.function(num_api_spec_tokens=num_api_spec_tokens)
    def profile(s, role):
        s += sgl.user("Write a short character profile of a teacher.")
        s += sgl.assistant(EXAMPLE)
        s += sgl.user(f"Write a short character profile of a {role}.")
        with s.assistant():
            for i, field in enumerate(FIELDS):
                s += ("" if i == 0 else "\n") + field.capitalize() + ":"
                s += sgl.gen(field, max_tokens=8, stop="\n")

    return profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running sglite (or SGLang) server; else one is started")
    args = parser.parse_args()
    runtime = None
    if args.url is None:
        runtime = sgl.Runtime()
        args.url = runtime.url
    try:
        for spec in (None, 48):
            backend = sgl.OpenAI("SmolLM2-135M-Instruct", base_url=args.url.rstrip("/") + "/v1")
            state = profile_program(spec).run(role="baker", backend=backend, temperature=0)
            if state.error():
                raise state.error()
            usage = backend.token_usage
            print(
                f"num_api_spec_tokens={spec}: API calls {usage.num_calls}, prompt tokens "
                f"{usage.prompt_tokens}, completion tokens {usage.completion_tokens}"
            )
            print("  " + ", ".join(f"{f}={state[f].strip()!r}" for f in FIELDS))
    finally:
        if runtime is not None:
            runtime.shutdown()


if __name__ == "__main__":
    main()
