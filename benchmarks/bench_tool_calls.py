"""Tool calls on a served model, as an agent drives them: the `openai` client against any
OpenAI-compatible server (sglite, or llama-server `--jinja` for comparison).

    python -m benchmarks.bench_tool_calls --model qwen2.5-coder-1.5b   # starts sglite on it
    python -m benchmarks.bench_tool_calls --url http://127.0.0.1:8080/v1  # a running server

Each case asks for the weather in Paris with a `get_weather(city)` and an `add(a, b)` tool, at
temperature 0, and prints what came back: a call is "ok" when its name is declared and its
arguments are JSON valid under the tool's schema. The two-step case sends the tool's result
back and reports whether the model then answers in text or calls again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import jsonschema
import openai

from benchmarks.common import launch_server, stop_process

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def valid(name: str, arguments: str) -> bool:
    """A call of a declared tool whose arguments are valid under its schema."""
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


def describe(calls: list[tuple[str, str]], content: str | None) -> tuple[str, str]:
    """(verdict, what came back) for one answer."""
    if calls:
        ok = all(valid(n, a) for n, a in calls)
        return ("ok" if ok else "invalid call"), "; ".join(f"{n}({a})" for n, a in calls)
    return "no call", repr((content or "")[:60])


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0}
    return client.chat.completions.create(**{**args, **kwargs})


def whole(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str]:
    message = ask(client, **kwargs).choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return describe(calls, message.content)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str]:
    calls: dict[int, list[str]] = {}
    content = ""
    for chunk in ask(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, ["", ""])
            entry[0] += piece.function.name or ""
            entry[1] += piece.function.arguments or ""
    return describe([(n, a) for n, a in calls.values()], content)


def two_step(client: openai.OpenAI) -> tuple[str, str]:
    first = ask(client).choices[0].message
    if not first.tool_calls:
        return "no call", repr((first.content or "")[:60])
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"}
    history = [*ASK, first.model_dump(exclude_none=True), result]
    second = ask(client, messages=history).choices[0].message
    if second.tool_calls:
        verdict, text = describe(
            [(c.function.name, c.function.arguments) for c in second.tool_calls], None
        )
        return f"calls again ({verdict})", text
    return "answer", repr((second.content or "")[:60])


CASES = {
    "auto": lambda c: whole(c),
    "required": lambda c: whole(c, tool_choice="required", parallel_tool_calls=False),
    "named": lambda c: whole(c, tool_choice={"type": "function", "function": {"name": "add"}}),
    "auto, streamed": lambda c: streamed(c),
    "required, streamed": lambda c: streamed(c, tool_choice="required"),
    "two steps (result sent back)": two_step,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="model sglite serves")
    ap.add_argument("--url", help="an OpenAI-compatible server already running (not started)")
    ap.add_argument("--port", type=int, default=31777)
    args = ap.parse_args(argv)
    flags = ["--model-path", args.model]
    proc = None if args.url else launch_server(flags, args.port, stdout=subprocess.DEVNULL)
    url = args.url or f"http://127.0.0.1:{args.port}/v1"
    client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "x"))
    try:
        print(f"server: {url} (model {args.model if proc else 'as served'})\n")
        print("| case | result | calls or text |\n|---|---|---|")
        for name, case in CASES.items():
            try:
                verdict, text = case(client)
            except openai.APIError as exc:
                verdict, text = "error", str(exc)[:80]
            print(f"| {name} | {verdict} | {text} |")
    finally:
        if proc is not None:
            stop_process(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
