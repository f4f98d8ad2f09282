"""API speculative execution benchmark: multi-field programs over an OpenAI-compatible `/v1`.

`--num-programs` character profiles, each six fields (name, age, job, hobby, city, pet), each
field a `gen` with `stop="\\n"`, run through `sgl.OpenAI` with and without
`@sgl.function(num_api_spec_tokens=N)`, as a completion model (`/v1/completions`, a few-shot
text prompt) and as a chat model (`/v1/chat/completions`, a worked example in an earlier turn,
the six fields in one assistant turn). Greedy throughout, so with and without speculation must
give the same values; the `same` column counts programs whose six values are identical.

Reported per API and mode: API calls, prompt tokens and completion tokens (the endpoint's own
`usage`, summed by the backend's `token_usage`), wall time of the batch (`run_batch` with
`--num-threads`), and the ratios without/with speculation. The server's prefix cache is flushed
before each configuration. The target is at least 3x fewer calls and 2x fewer prompt tokens.

Run against a running server (sglite, or any OpenAI-compatible endpoint with `--model`):
    python -m benchmarks.bench_api_spec --base-url http://127.0.0.1:30000
or let it start one:
    python -m benchmarks.bench_api_spec --launch [--server-args "--dtype float32"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Any

import sglite as sgl
from benchmarks.common import (
    add_json_option,
    add_server_options,
    command_line,
    discover_model,
    flush_cache,
    free_port,
    launch_server,
    make_parser,
    markdown_table,
    stop_process,
)

FIELDS = ("name", "age", "job", "hobby", "city", "pet")
FIRST_NAMES = (
    "Carol Dan Erin Frank Grace Henry Iris Jack Kate Liam Mia Noah Olive Paul Quinn Rose Sam "
    "Tina Uma Victor Wendy Xavier Yara Zoe Adam Bella Chris Diana Ethan Fiona George Hannah"
).split()
ROLES = (
    "baker nurse pilot farmer painter lawyer chef dentist plumber teacher writer singer "
    "doctor sailor miner tailor banker barber drummer florist jeweler librarian mechanic "
    "poet potter ranger surgeon typist vet waiter welder zookeeper"
).split()

FEW_SHOT = (
    "Character profiles.\n\n"
    "Name: Alice Smith\nAge: 34\nJob: teacher\nHobby: painting\nCity: Boston\nPet: cat\n\n"
    "Name: Bob Jones\nAge: 52\nJob: baker\nHobby: fishing\nCity: Denver\nPet: dog\n\n"
)
CHAT_EXAMPLE = "Name: Alice Smith\nAge: 34\nJob: teacher\nHobby: painting\nCity: Boston\nPet: cat"


def completion_program(spec: int | None, max_tokens: int) -> Any:
    """Few-shot profiles; the program gives the first name, the model the rest."""

    @sgl.function(num_api_spec_tokens=spec)
    def profile(s, first):
        s += FEW_SHOT + "Name: " + first
        s += sgl.gen("name", max_tokens=max_tokens, stop="\n")
        for field in FIELDS[1:]:
            s += "\n" + field.capitalize() + ":"
            s += sgl.gen(field, max_tokens=max_tokens, stop="\n")

    return profile


def chat_program(spec: int | None, max_tokens: int) -> Any:
    """One worked example turn, then the six fields in one assistant turn."""

    @sgl.function(num_api_spec_tokens=spec)
    def profile(s, role):
        s += sgl.user("Write a short character profile of a teacher.")
        s += sgl.assistant(CHAT_EXAMPLE)
        s += sgl.user(f"Write a short character profile of a {role}.")
        with s.assistant():
            for i, field in enumerate(FIELDS):
                s += ("" if i == 0 else "\n") + field.capitalize() + ":"
                s += sgl.gen(field, max_tokens=max_tokens, stop="\n")

    return profile


@dataclass
class Row:
    """One configuration's totals."""

    api: str
    spec: str
    programs: int
    failed: int
    calls: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    same: int | None = None


def run_config(
    api: str, spec: int | None, args: argparse.Namespace, v1: str, model: str
) -> tuple[Row, list[dict[str, str] | None]]:
    """Run the batch once; returns the totals and each program's values (None if it failed)."""
    backend = sgl.OpenAI(model, base_url=v1, api_key=args.api_key, is_chat_model=api == "chat")
    if api == "chat":
        program = chat_program(spec, args.max_tokens)
        batch = [{"role": ROLES[i % len(ROLES)]} for i in range(args.num_programs)]
    else:
        program = completion_program(spec, args.max_tokens)
        batch = [{"first": FIRST_NAMES[i % len(FIRST_NAMES)]} for i in range(args.num_programs)]
    flush_cache(args.base_url)
    start = time.perf_counter()
    states = program.run_batch(batch, backend=backend, temperature=0, num_threads=args.num_threads)
    wall = time.perf_counter() - start
    results: list[dict[str, str] | None] = []
    for state in states:
        if state.error() is not None:
            print(f"  a program failed: {state.error()}", flush=True)
            results.append(None)
        else:
            results.append({f: state[f] for f in FIELDS})
    usage = backend.token_usage
    row = Row(
        api=api,
        spec="off" if spec is None else f"N={spec}",
        programs=len(batch),
        failed=sum(r is None for r in results),
        calls=usage.num_calls,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        wall_s=wall,
    )
    return row, results


def ratio(a: float, b: float) -> str:
    """a / b as "1.23x"; "-" when b is 0."""
    return f"{a / b:.2f}x" if b else "-"


def print_table(rows: list[Row]) -> None:
    """A Markdown table: every configuration, then the without/with ratio per API."""
    heads = ["api", "speculation", "programs", "failed", "calls", "prompt tokens",
             "completion tokens", "wall s", "same values"]  # fmt: skip
    cells = [
        [r.api, r.spec, str(r.programs), str(r.failed), str(r.calls), str(r.prompt_tokens),
         str(r.completion_tokens), f"{r.wall_s:.1f}", "-" if r.same is None else str(r.same)]
        for r in rows
    ]  # fmt: skip
    for off, on in zip(rows[::2], rows[1::2]):
        cells.append(
            [off.api, "off / on", "", "", ratio(off.calls, on.calls),
             ratio(off.prompt_tokens, on.prompt_tokens),
             ratio(off.completion_tokens, on.completion_tokens), ratio(off.wall_s, on.wall_s),
             ""]
        )  # fmt: skip
    print(markdown_table(heads, cells))


# ---------------------------------------------------------------------------- driver
def warm_up(v1: str, model: str, api_key: str | None) -> None:
    """One short call per API, so start-up costs do not land in the first configuration."""
    backend = sgl.OpenAI(model, base_url=v1, api_key=api_key)
    backend.client.completions.create(model=model, prompt="Hello", max_tokens=2)
    backend.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=2
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    add_server_options(p)
    p.add_argument("--api", default="completion,chat", help="completion, chat or both")
    p.add_argument("--num-programs", type=int, default=32)
    p.add_argument("--spec-tokens", type=int, default=48, help="num_api_spec_tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each field")
    p.add_argument("--num-threads", type=int, default=8, help="run_batch threads")
    add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run each API without and with speculation; print the table."""
    args = parse_args(argv)
    proc = None
    if args.launch:
        port = free_port()
        args.base_url = f"http://127.0.0.1:{port}"
        proc = launch_server(shlex.split(args.server_args), port)
    args.base_url = args.base_url.rstrip("/")
    v1 = args.base_url + "/v1"
    try:
        model = args.model or discover_model(args.base_url)
        if model is None:
            raise SystemExit(f"{v1}/models lists no model: give --model")
        warm_up(v1, model, args.api_key)
        rows: list[Row] = []
        for api in [a.strip() for a in args.api.split(",") if a.strip()]:
            if api not in ("completion", "chat"):
                raise SystemExit(f"--api: unknown {api!r} (completion, chat)")
            print(f"[{api}] {args.num_programs} programs without speculation ...", flush=True)
            off, plain = run_config(api, None, args, v1, model)
            print(f"[{api}] with num_api_spec_tokens={args.spec_tokens} ...", flush=True)
            on, spec = run_config(api, args.spec_tokens, args, v1, model)
            on.same = sum(a is not None and a == b for a, b in zip(plain, spec))
            rows += [off, on]
        print()
        print("command: " + command_line("benchmarks.bench_api_spec"))
        print(
            f"model={model} url={v1} programs={args.num_programs} fields={len(FIELDS)} "
            f"max_tokens={args.max_tokens} threads={args.num_threads} greedy"
        )
        print_table(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([asdict(r) for r in rows], f, indent=2)
    finally:
        if proc is not None:
            stop_process(proc)


if __name__ == "__main__":
    main()
