"""Engine benchmark: sglite vs Hugging Face transformers on the default model, in one run.

Figures: prefill tokens/s on a 1000-token prompt, batch-1 decode tokens/s, and the shared-prefix
workload (64 requests = 800-token shared prefix + a distinct 30-token question, 64 new tokens
each, greedy): end-to-end output tokens/s and cache hit rate. Ratios are what to quote; absolute
times on a shared 2-core machine are noisy.

Run: python -m benchmarks.bench_engine [--quick] [--hf-batch-size 16]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from dataclasses import dataclass

import torch

import sglite
from sglite.runtime.model.loader import default_model_path


@dataclass
class Row:
    """One line of the results table."""

    metric: str
    system: str
    value: float
    unit: str


def make_words(n_tokens: int, seed: int) -> str:
    """Synthetic text of roughly n_tokens tokens (no dataset download needed)."""
    rng = random.Random(seed)
    vocab = (
        "the of and a to in is you that it he was for on are as with his they at be this have "
        "from or one had by word but not what all were we when your can said there use an each "
        "which she do how their if will up other about out many then them these so some her would "
        "make like him into time has look two more write go see number no way could people my "
        "than first water been call who oil its now find long down day did get come made may part"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(n_tokens))


def exact_prompt_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """Token ids of synthetic text cut to exactly n_tokens."""
    ids = tokenizer.encode(make_words(n_tokens * 2, seed))
    return ids[:n_tokens]


def shared_prefix_workload(tokenizer, n_requests: int) -> list[list[int]]:
    """64 x (800 shared + 30 distinct tokens)."""
    prefix = exact_prompt_ids(tokenizer, 800, seed=1)
    return [prefix + exact_prompt_ids(tokenizer, 30, seed=100 + i) for i in range(n_requests)]


def bench_sglite(args: argparse.Namespace, rows: list[Row]) -> None:
    """Measure sglite's Engine (default dtype: bfloat16 where the CPU has it)."""
    with sglite.Engine(dtype=args.dtype, log_level="error") as engine:
        tok = engine.tokenizer
        dtype = engine.get_server_info()["dtype"]
        name = f"sglite ({dtype})"
        prompt = exact_prompt_ids(tok, 1000, seed=0)
        engine.generate(input_ids=prompt[:100], sampling_params={"max_new_tokens": 2})  # warm-up
        times = []
        for _ in range(args.repeats):
            engine.flush_cache()
            start = time.perf_counter()
            engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
            times.append(time.perf_counter() - start)
        rows.append(Row("prefill 1000 tokens", name, 1000 / min(times), "tok/s"))

        short = exact_prompt_ids(tok, 16, seed=3)
        greedy = {"temperature": 0, "ignore_eos": True}
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(input_ids=short, sampling_params={**greedy, "max_new_tokens": 1})
        first = time.perf_counter() - start
        engine.flush_cache()
        start = time.perf_counter()
        n_dec = args.decode_tokens
        engine.generate(input_ids=short, sampling_params={**greedy, "max_new_tokens": n_dec + 1})
        total = time.perf_counter() - start
        rows.append(Row("batch-1 decode", name, n_dec / (total - first), "tok/s"))

        engine.flush_cache()
        before = engine.get_server_info()
        work = shared_prefix_workload(tok, args.requests)
        start = time.perf_counter()
        outs = engine.generate(
            input_ids=work, sampling_params={**greedy, "max_new_tokens": args.new_tokens}
        )
        elapsed = time.perf_counter() - start
        after = engine.get_server_info()
        out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        hit = (after["cached_prompt_tokens"] - before["cached_prompt_tokens"]) / max(
            1, after["queried_prompt_tokens"] - before["queried_prompt_tokens"]
        )
        rows.append(Row("shared-prefix workload", name, out_tokens / elapsed, "out tok/s"))
        rows.append(Row("shared-prefix cache hit rate", name, 100 * hit, "%"))
        rows.append(Row("shared-prefix wall time", name, elapsed, "s"))


def bench_transformers(args: argparse.Namespace, rows: list[Row], dtype: torch.dtype) -> None:
    """Measure transformers' generate on the same GGUF weights, same thread count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    folder, fname = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype).eval()
    name = f"transformers ({str(dtype).replace('torch.', '')})"
    prompt = exact_prompt_ids(tok, 1000, seed=0)
    with torch.inference_mode():
        model(torch.tensor([prompt[:100]]))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model(torch.tensor([prompt]))
            times.append(time.perf_counter() - start)
        rows.append(Row("prefill 1000 tokens", name, 1000 / min(times), "tok/s"))

        short = torch.tensor([exact_prompt_ids(tok, 16, seed=3)])
        n_dec = args.decode_tokens
        kw = {"do_sample": False, "pad_token_id": tok.eos_token_id}
        start = time.perf_counter()
        model.generate(short, max_new_tokens=1, min_new_tokens=1, **kw)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(short, max_new_tokens=n_dec + 1, min_new_tokens=n_dec + 1, **kw)
        total = time.perf_counter() - start
        rows.append(Row("batch-1 decode", name, n_dec / (total - first), "tok/s"))

        if args.skip_hf_workload:
            return
        work = shared_prefix_workload(tok, args.requests)
        bs = args.hf_batch_size
        start = time.perf_counter()
        out_tokens = 0
        for i in range(0, len(work), bs):
            batch = torch.tensor(work[i : i + bs])  # equal lengths: no padding needed
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                **kw,
            )
            out_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
        rows.append(Row("shared-prefix workload", name, out_tokens / elapsed, "out tok/s"))
        rows.append(Row("shared-prefix wall time", name, elapsed, "s"))


def print_table(rows: list[Row]) -> str:
    """Markdown table with each sglite figure's ratio to each transformers figure."""
    lines = ["| metric | system | value | unit |", "|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r.metric} | {r.system} | {r.value:,.1f} | {r.unit} |")
    lines += ["", "| metric | sglite / transformers |", "|---|---:|"]
    ours = {r.metric: r for r in rows if r.system.startswith("sglite")}
    for r in rows:
        if r.system.startswith("transformers") and r.metric in ours and r.unit != "s":
            lines.append(f"| {r.metric} vs {r.system} | {ours[r.metric].value / r.value:.2f}x |")
    text = "\n".join(lines)
    print(text)
    return text


def main() -> None:
    """Parse flags, run both systems, print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf-workload", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.decode_tokens, args.repeats = 16, 16, 32, 1
    torch.set_num_threads(os.cpu_count() or 1)
    rows: list[Row] = []
    bench_sglite(args, rows)
    bench_transformers(args, rows, torch.float32)
    bench_transformers(args, rows, torch.bfloat16)
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
