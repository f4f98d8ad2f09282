"""Accuracy of each weight format in bench_engine: its logits against float32 dense on the same
token sequences (teacher forcing), as max logit error and greedy agreement."""

from __future__ import annotations

import argparse

import torch

from benchmarks.engine_rows import Row
from benchmarks.engine_sglite import format_name, split_format

ACCURACY_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Write a haiku about the sea:\n",
]


def teacher_forced(loaded, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Prefill, then decode one token at a time (the batch-1 path): the logits before each of
    `steps` tokens, and the tokens (`forced`, else the model's own greedy choices)."""
    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode

    cfg = loaded.config
    pool = KVPool(512, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    slots = pool.alloc(len(prompt))
    n = len(prompt)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [0], [slots], [n - 1])
    out, tokens = [loaded.model(batch, pool)[0]], []
    for i in range(steps):
        tokens.append(forced[i] if forced is not None else int(out[-1].argmax()))
        if i + 1 == steps:
            break
        slots = slots + pool.alloc(1)
        step = [[tokens[-1]]]
        batch = ForwardBatch.build(ForwardMode.DECODE, step, [len(slots) - 1], [slots], [0])
        out.append(loaded.model(batch, pool)[0])
    return torch.stack(out), tokens


def bench_accuracy(args: argparse.Namespace, rows: list[Row]) -> None:
    """Each weight format against float32 dense on the same token sequences (teacher forcing)."""
    from sglite.runtime.model.loader import load_model

    ref_model = load_model(args.model, "float32", progress=False)
    tok = ref_model.tokenizer
    cases = []
    for text in ACCURACY_PROMPTS:
        prompt = tok.encode(text)
        ref_logits, forced = teacher_forced(ref_model, prompt, args.accuracy_tokens)
        cases.append((prompt, forced, ref_logits))
    formats = [("bfloat16", "none")]
    formats += [("bfloat16", q) for q in args.quantizations if q not in ("none", "w4a8")]
    formats += [("float32", q) for q in args.quantizations if q != "none"]
    for dtype, spec in formats:
        quantization, activations = split_format(spec)
        loaded = load_model(
            args.model,
            dtype,
            progress=False,
            quantization=quantization,
            gguf_activations=activations,
        )
        worst, agree, total = 0.0, 0, 0
        for prompt, forced, ref in cases:
            ours, _ = teacher_forced(loaded, prompt, len(forced), forced)
            worst = max(worst, float((ours - ref).abs().max()))
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            total += len(forced)
        kind = loaded.quantization if quantization == "auto" else quantization
        name = f"{dtype} {format_name(kind, loaded.activations)}"
        rows.append(Row("max |logit error| vs float32", name, worst, ""))
        rows.append(Row("greedy agreement vs float32", name, 100 * agree / total, "%"))
