"""Tool-calling agent: the model calls real Python functions through `sgl.gen(..., tools=...)`.

Pattern: the tools are plain functions (their JSON schemas come from the signatures and
docstrings); `gen` with `tools` makes the model's turn a call of one of them, enforced by the
runtime's grammar so it always parses, even on the 135M default model; Python runs the call and
appends the result as a `tool` turn; a last `gen` answers from it.

Run: python examples/tool_agent.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json

import sglite as sgl

WEATHER = {"paris": (18, "cloudy"), "oslo": (4, "snow"), "lima": (22, "sunny")}


def get_weather(city: str) -> str:
    """The current temperature (Celsius) and sky of a city."""
    temperature, sky = WEATHER.get(city.strip().lower(), (None, "unknown"))
    return json.dumps({"city": city, "temperature_c": temperature, "sky": sky})


def add(a: float, b: float) -> float:
    """The sum of two numbers."""
    return a + b


TOOLS = [get_weather, add]


@sgl.function
def tool_agent(s, question):
    s += sgl.system("You are a helpful assistant. " + sgl.tools_prompt(TOOLS))
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("call", tools=TOOLS, max_tokens=64))
    for call in s.tool_calls("call"):
        result = sgl.call_tool(TOOLS, call)
        s += sgl.user(f"Result of {call['name']}({json.dumps(call['arguments'])}): {result}")
    s += sgl.assistant(sgl.gen("answer", max_tokens=40))


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    state = tool_agent.run(question="What is the weather in Paris?", backend=backend, temperature=0)
    if state.error():
        raise state.error()
    for call in state.tool_calls("call"):
        print(f"called {call['name']}({json.dumps(call['arguments'])})")
    print("answer:", state["answer"])
    backend.shutdown()


if __name__ == "__main__":
    main()
