"""Batch-1 decode with and without speculative decoding, alternated round by round.

Two engines on the same model (`--speculative-algorithm ngram` or `draft`, and without), greedy, one
request at a time. Per workload and round: the decode rate of each (output tokens / time, with
the prompt already in the radix cache and a 1-token run's time subtracted, so prefill drops
out), then the ratio; the table gives the median ratio over rounds, both rates' medians and the
speculative engine's acceptance (accepted / drafted tokens) and tokens per forward
(emitted / (emitted - accepted): each forward emits one token plus the accepted drafts).

Workloads: (a) copy-heavy: repeating a passage, editing code, quoting a retrieved passage,
filling a JSON record from a document; (b) free chat; (c) free chat asked again: the same
prompt once more with the first answer in the radix cache (an agent re-running a step), where
n-gram drafts come from the cache. Every other run starts from a flushed cache with only its
prompt cached, so earlier rounds' answers cannot draft for it. The outputs of the two engines
are compared too (they must be identical: speculation does not change greedy answers).

With `--algorithm draft` the draft model is `--draft-model-path` (default: the target's own
file, i.e. self-speculation), optionally only its first `--draft-num-layers` layers and in
`--draft-quantization`.

With llama.cpp's `llama-server` found (`--llama-server PATH`, on PATH, or built by
`benchmarks/build_llama_cpp.sh`), the same rounds also run it on the same GGUF and prompts,
one slot, greedy, prompt cached: without speculation and with each of its n-gram draft types in
`LLAMA_SPEC` (its decode rate is its own `timings.predicted_per_second`, which excludes the
prompt); the table shows its plain rate and its best n-gram configuration per workload.

Run: python -m benchmarks.bench_spec [--rounds 3] [--tokens 96] [--quantization auto]
     [--algorithm ngram|draft] [--draft-model-path P] [--draft-quantization Q]
     [--draft-num-layers N] [--no-llama] [--workloads NAME_PREFIX ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import torch

import sglite
from benchmarks.bench_json import _free_port, _post
from benchmarks.runners.llama_cpp import find_llama_server, llama_version

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
    "free chat, asked again": CHAT.format("Give me some advice on learning to play the piano."),
}
# Workloads whose measured run follows the same request's full run (its answer cached).
REASKED = {"free chat, asked again"}


# llama-server's n-gram speculation: its default n-gram lookup, the same with a short lookup and
# draft (its best on these prompts), and its n-gram-mod type.
LLAMA_SPEC = {
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-simple n3 m8": (
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
    ),
    "ngram-mod": ("--spec-type", "ngram-mod"),
}  # fmt: skip


def decode_run(
    engine: sglite.Engine, prompt: str, tokens: int, reask: bool
) -> tuple[float, dict, list]:
    """(decode tok/s, the run's meta_info, output ids) from a flushed cache with the prompt
    cached beforehand (with `reask`, the whole answer too)."""
    params = {"temperature": 0, "max_new_tokens": 1}
    engine.flush_cache()
    engine.generate(prompt, {**params, "max_new_tokens": tokens if reask else 1})
    start = time.perf_counter()
    engine.generate(prompt, params)
    first = time.perf_counter() - start
    start = time.perf_counter()
    out = engine.generate(prompt, {**params, "max_new_tokens": tokens})
    total = time.perf_counter() - start
    done = out["meta_info"]["completion_tokens"] - 1
    return done / max(total - first, 1e-9), out["meta_info"], out["output_ids"]


class LlamaServer:
    """One llama-server (one slot) on the default GGUF with the given speculative flags."""

    def __init__(self, binary: str, model_path: str, threads: int, extra: tuple[str, ...]):
        port = _free_port()
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        cmd = [
            binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096", "-ngl", "0",
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited; see {self.log.name}")
            try:
                _post(self.base + "/tokenize", {"content": "x"}, timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("llama-server did not start")

    def decode_run(self, prompt: str, tokens: int) -> tuple[float, int, int]:
        """(decode tok/s, drafted, accepted) with the prompt cached beforehand."""
        body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": True}
        _post(self.base + "/completion", {**body, "n_predict": 1})
        timings = _post(self.base + "/completion", body)["timings"]
        return (
            timings["predicted_per_second"],
            timings.get("draft_n", 0),
            timings.get("draft_n_accepted", 0),
        )

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Tally:
    """One system's rates and draft counts over the rounds of one workload."""

    rates: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def acceptance(self) -> str:
        return f"{100 * self.accepted / self.drafted:.0f}%" if self.drafted else "-"


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


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--llama-server", default=None, help="llama-server binary")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument(
        "--workloads", nargs="*", default=None, help="names (or name prefixes) of workloads to run"
    )
    return parser.parse_args()


def start_llama(args: argparse.Namespace, model_path: str) -> dict[str, LlamaServer]:
    """llama-server without speculation ("off") and with each `LLAMA_SPEC` configuration."""
    if args.no_llama:
        return {}
    binary, why = find_llama_server(args.llama_server)
    if binary is None:
        print(f"llama.cpp skipped: {why}")
        return {}
    print(f"llama.cpp {llama_version(binary)} ({why}): {binary}")
    threads = torch.get_num_threads()
    configs = {"off": (), **LLAMA_SPEC}
    return {name: LlamaServer(binary, model_path, threads, cfg) for name, cfg in configs.items()}


def main() -> None:
    """Alternate the engines (and llama-servers) per workload and round; print the table."""
    args = parse_args()
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
    llama = start_llama(args, info["model_path"])
    rows = []
    try:
        for name, prompt in WORKLOADS.items():
            if args.workloads and not any(name.startswith(w) for w in args.workloads):
                continue
            reask = name in REASKED
            rows.append((name, *run_workload(args, plain, spec, llama, prompt, reask)))
            print(f"  {name}: {rows[-1][2].rate / rows[-1][1].rate:.2f}x", flush=True)
    finally:
        plain.shutdown()
        spec.shutdown()
        for server in llama.values():
            server.close()
    print_table(args, rows, bool(llama))


def run_workload(
    args: argparse.Namespace,
    plain: sglite.Engine,
    spec: sglite.Engine,
    llama: dict[str, LlamaServer],
    prompt: str,
    reask: bool,
) -> tuple[Tally, Tally, float, bool, Tally | None, tuple[str, Tally] | None]:
    """(off, speculative, median ratio, same output, llama.cpp off, best llama.cpp n-gram)."""
    off, on, ratios, emitted, same = Tally(), Tally(), [], 0, True
    peers = {name: Tally() for name in llama}
    for _ in range(args.rounds):
        rate_off, _, ids_off = decode_run(plain, prompt, args.tokens, reask)
        rate_on, meta, ids_on = decode_run(spec, prompt, args.tokens, reask)
        off.rates.append(rate_off)
        on.rates.append(rate_on)
        ratios.append(rate_on / rate_off)
        on.drafted += meta["spec_draft_tokens"]
        on.accepted += meta["spec_accepted_tokens"]
        emitted += meta["completion_tokens"]
        same = same and ids_on == ids_off
        for name, server in llama.items():
            rate, drafted, accepted = server.decode_run(prompt, args.tokens)
            peers[name].rates.append(rate)
            peers[name].drafted += drafted
            peers[name].accepted += accepted
    per_forward = emitted / max(emitted - on.accepted, 1)
    if not llama:
        return off, on, statistics.median(ratios), per_forward, same, None, None
    best = max((n for n in peers if n != "off"), key=lambda n: peers[n].rate)
    return off, on, statistics.median(ratios), per_forward, same, peers["off"], (best, peers[best])


def print_table(args: argparse.Namespace, rows: list, with_llama: bool) -> None:
    head = (
        f"| workload | off (tok/s) | {args.algorithm} (tok/s) | speedup (median) | acceptance "
        "| tokens per forward | same output |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---|"
    if with_llama:
        head += " llama.cpp off | llama.cpp best n-gram (tok/s, acceptance) | vs llama.cpp n-gram |"
        rule += "---:|---|---:|"
    print("\n" + head + "\n" + rule)
    for name, off, on, ratio, per_forward, same, peer_off, peer in rows:
        line = (
            f"| {name} | {off.rate:.1f} | {on.rate:.1f} | {ratio:.2f}x | {on.acceptance} "
            f"| {per_forward:.2f} | {'yes' if same else 'NO'} |"
        )
        if peer is not None:
            config, best = peer
            line += (
                f" {peer_off.rate:.1f} | {best.rate:.1f} ({config}, {best.acceptance}) "
                f"| {on.rate / best.rate:.2f}x |"
            )
        print(line)


if __name__ == "__main__":
    main()
