"""int4 (weight-only) against w4a8 (int8-rounded activations) and dense, on the default model.

Three questions, one run, all three weight formats loaded in this process:
- speed: decode steps of B rows (the model driven in-process, native decode step), the formats
  alternated round by round so the host's drift hits them alike; median ms per step;
- accuracy: logits against dense float32 with the same tokens forced (teacher forcing), the
  prefill and one decode step per token: max |error| and greedy agreement;
- consistency: greedy answers of chat prompts through an Engine, each prompt alone, again with
  its prompt cached, and all of them as one batch: how many come out the same.

Run: python -m benchmarks.bench_int4 [--batches 1 4 8 32] [--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_engine import teacher_forced
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.loader import LoadedModel, load_model

FORMATS = ("none", "int4", "w4a8")
TOPICS = "rain sun moon cats dogs rivers trees stars music bread glass iron gold salt wind snow"
ACCURACY_TEXTS = [
    ("Photosynthesis turns light, water and carbon dioxide into", " sugar and oxygen in leaves"),
    ("def fibonacci(n):\n    ", "if n < 2:\n        return n\n    return fibonacci(n - 1)"),
    ("The capital of France is", " Paris, a city on the Seine known for the Eiffel Tower."),
    ("Q: What is 17 * 23?\nA:", " 17 * 23 = 391. The answer is 391."),
]


def new_pool(loaded: LoadedModel, tokens: int = 4096) -> KVPool:
    cfg = loaded.config
    return KVPool(tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)


def decode_ms(loaded: LoadedModel, rows: int, steps: int) -> float:
    """One measurement: ms per decode step of `rows` requests (40-token prompts)."""
    pool = new_pool(loaded)
    prompt = list(range(100, 140))
    slots = [pool.alloc(len(prompt)) for _ in range(rows)]
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, [prompt] * rows, [0] * rows, slots, [len(prompt) - 1] * rows
    )
    loaded.model(batch, pool)
    tokens = [[5]] * rows
    start = time.perf_counter()
    for _ in range(steps):
        slots = [s + pool.alloc(1) for s in slots]
        positions = [len(s) - 1 for s in slots]
        batch = ForwardBatch.build(ForwardMode.DECODE, tokens, positions, slots, [0] * rows)
        tokens = [[int(t)] for t in loaded.model(batch, pool).argmax(-1)]
    return (time.perf_counter() - start) / steps * 1e3


def consistency(quantization: str, dtype: str, tokens: int) -> tuple[int, int, int]:
    """(prompts, answers alike when cached, answers alike in one batch) for 16 chat prompts."""
    import sglite

    prompts = [
        f"<|im_start|>user\nTell me a short fact about {word}.<|im_end|>\n<|im_start|>assistant\n"
        for word in TOPICS.split()
    ]
    greedy = {"temperature": 0, "max_new_tokens": tokens}
    with sglite.Engine(dtype=dtype, quantization=quantization, log_level="error") as engine:
        alone = [engine.generate(p, greedy)["text"] for p in prompts]
        cached = [engine.generate(p, greedy)["text"] for p in prompts]
        engine.flush_cache()
        batched = [out["text"] for out in engine.generate(prompts, greedy)]
    same = sum(a == b for a, b in zip(alone, cached, strict=True))
    return len(prompts), same, sum(a == b for a, b in zip(alone, batched, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {q: load_model(None, args.dtype, progress=False, quantization=q) for q in FORMATS}
    print(f"dtype {args.dtype}, {args.threads} threads, {args.rounds} alternated rounds\n")
    print("| decode rows | " + " | ".join(f"{q} ms/step" for q in FORMATS) + " | int4 vs dense |")
    print("|---:|" + "---:|" * (len(FORMATS) + 1))
    for rows in args.batches:
        times: dict[str, list[float]] = {q: [] for q in FORMATS}
        for _ in range(args.rounds):
            for q in FORMATS:
                times[q].append(decode_ms(models[q], rows, args.steps))
        med = {q: statistics.median(v) for q, v in times.items()}
        cells = " | ".join(f"{med[q]:.1f} ({rows / med[q] * 1e3:.0f} tok/s)" for q in FORMATS)
        print(f"| {rows} | {cells} | {med['none'] / med['int4']:.2f}x |")

    tok = models["none"].tokenizer
    cases = [(tok.encode(p), tok.encode(f)) for p, f in ACCURACY_TEXTS]
    refs = [teacher_forced(models["none"], p, len(f), f)[0] for p, f in cases]
    print(
        "\n| weights | max \\|logit error\\| vs dense | greedy agreement | answers alike "
        "cached | answers alike in one batch |\n|---|---:|---:|---:|---:|"
    )
    for q in FORMATS:
        worst, agree, total = 0.0, 0, 0
        for (prompt, forced), ref in zip(cases, refs, strict=True):
            ours = teacher_forced(models[q], prompt, len(forced), forced)[0]
            worst = max(worst, float((ours - ref).abs().max()))
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            total += len(forced)
        n, cached, batched = consistency(q, args.dtype, 48)
        print(
            f"| {q} | {worst:.2f} | {100 * agree / total:.1f}% ({total}) | {cached}/{n} | "
            f"{batched}/{n} |"
        )


if __name__ == "__main__":
    main()
