"""Batch-1 decode with and without speculative decoding, alternated round by round.

Two engines on the same model (`--speculative-algorithm ngram` or `draft`, and without), greedy, one
request at a time. Per workload and round: the decode rate of each (output tokens / time, with
the prompt already in the radix cache and a 1-token run's time subtracted, so prefill drops
out), then the ratio; the table gives the median ratio over rounds, both rates' medians and the
speculative engine's acceptance (accepted / drafted tokens) and tokens per forward
(emitted / (emitted - accepted): each forward emits one token plus the accepted drafts).

Workloads: (a) copy-heavy: repeating a passage, editing code, quoting a retrieved passage,
filling a JSON record from a document; (b) free chat. The outputs of the two engines are
compared too (they must be identical: speculation does not change greedy answers).

With `--algorithm draft` the draft model is `--draft-model-path` (default: the target's own
file, i.e. self-speculation), optionally only its first `--draft-num-layers` layers and in
`--draft-quantization`.

Run: python -m benchmarks.bench_spec [--rounds 3] [--tokens 96] [--quantization auto]
     [--algorithm ngram|draft] [--draft-model-path P] [--draft-quantization Q]
     [--draft-num-layers N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sglite

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PASSAGE = (
    "Radix attention keeps the key-value cache of finished requests in a radix tree, so that a "
    "new request sharing a prefix with an earlier one reuses its cached keys and values instead "
    "of computing them again. The tree is evicted leaf first, least recently used first, and a "
    "request's path is locked while it runs so that its cache cannot be evicted under it."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n"
)
DOCUMENT = (
    "Invoice 2291 was issued on 3 March 2025 by Northwind Traders, 12 Harbour Street, Bristol, "
    "to Contoso Ltd for 40 units of item A-113 at 12.50 each, total 500.00, due in 30 days."
)
WORKLOADS = {
    "copy: repeat a passage": CHAT.format(f"Repeat this text exactly:\n\n{PASSAGE}"),
    "copy: edit code": CHAT.format(f"Rename `values` to `xs` everywhere in this code:\n\n{CODE}"),
    "copy: quote a retrieved passage": CHAT.format(
        f"Context:\n{PASSAGE}\n\nQuestion: how is the cache evicted? Answer by quoting the context."
    ),
    "copy: JSON record from a document": CHAT.format(
        f"Document:\n{DOCUMENT}\n\nWrite the invoice as a JSON object with fields number, date, "
        "seller, buyer, item, quantity, unit_price and total."
    ),
    "free chat": CHAT.format("Write a short story about a robot who learns to paint."),
    "free chat: advice": CHAT.format("Give me some advice on learning to play the piano."),
}


def decode_run(engine: sglite.Engine, prompt: str, tokens: int) -> tuple[float, dict, list]:
    """(decode tok/s, the run's meta_info, output ids) with the prompt cached beforehand."""
    params = {"temperature": 0, "max_new_tokens": 1}
    engine.generate(prompt, params)  # the prompt is now in the radix cache
    start = time.perf_counter()
    engine.generate(prompt, params)
    first = time.perf_counter() - start
    start = time.perf_counter()
    out = engine.generate(prompt, {**params, "max_new_tokens": tokens})
    total = time.perf_counter() - start
    done = out["meta_info"]["completion_tokens"] - 1
    return done / max(total - first, 1e-9), out["meta_info"], out["output_ids"]


def speculation_args(args: argparse.Namespace, plain: sglite.Engine) -> dict:
    """The speculative engine's keywords (a draft model defaults to the target's own file)."""
    spec = {
        "speculative_algorithm": args.algorithm,
        "speculative_num_draft_tokens": args.num_draft_tokens,
    }
    if args.algorithm == "draft":
        spec["speculative_draft_model_path"] = (
            args.draft_model_path or plain.get_server_info()["model_path"]
        )
        spec["speculative_draft_model_quantization"] = args.draft_quantization
        spec["speculative_draft_num_layers"] = args.draft_num_layers
    return spec


def main() -> None:
    """Alternate the two engines per workload and round; print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--algorithm", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft-model-path", default=None)
    parser.add_argument("--draft-quantization", default="auto")
    parser.add_argument("--draft-num-layers", type=int, default=None)
    args = parser.parse_args()
    common = {"dtype": args.dtype, "quantization": args.quantization, "log_level": "error"}
    plain = sglite.Engine(**common)
    spec = sglite.Engine(**common, **speculation_args(args, plain))
    info = spec.get_server_info()
    print(f"model {info['model_path']}, {info['dtype']}, weights {info['weight_layouts']}, ")
    print(f"kernels {info['kernel_isa'] or 'portable C'}, torch threads {torch.get_num_threads()}")
    if args.algorithm == "draft":
        draft = info["speculative_draft"]
        print(
            f"draft model {draft['model_path']}, weights {draft['quantization']}, "
            f"{draft['num_layers']} layers"
        )
    rows = []
    for name, prompt in WORKLOADS.items():
        ratios, rates_off, rates_on, drafted, accepted, emitted, same = [], [], [], 0, 0, 0, True
        for _ in range(args.rounds):
            off, _, ids_off = decode_run(plain, prompt, args.tokens)
            on, meta, ids_on = decode_run(spec, prompt, args.tokens)
            ratios.append(on / off)
            rates_off.append(off)
            rates_on.append(on)
            drafted += meta["spec_draft_tokens"]
            accepted += meta["spec_accepted_tokens"]
            emitted += meta["completion_tokens"]
            same = same and ids_on == ids_off
        rows.append(
            (
                name,
                statistics.median(rates_off),
                statistics.median(rates_on),
                statistics.median(ratios),
                accepted / max(drafted, 1),
                emitted / max(emitted - accepted, 1),
                same,
            )
        )
        print(f"  {name}: {rows[-1][3]:.2f}x", flush=True)
    plain.shutdown()
    spec.shutdown()
    print(
        f"\n| workload | off (tok/s) | {args.algorithm} (tok/s) | speedup (median) | acceptance "
        "| tokens per forward | same output |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, off, on, ratio, acceptance, per_forward, same in rows:
        print(
            f"| {name} | {off:.1f} | {on:.1f} | {ratio:.2f}x | {100 * acceptance:.0f}% "
            f"| {per_forward:.2f} | {'yes' if same else 'NO'} |"
        )


if __name__ == "__main__":
    main()
