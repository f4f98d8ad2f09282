"""Batch-1 decode with and without speculative decoding, alternated round by round.

Two engines on the same model (`--speculative-algorithm ngram` or `draft`, and without),
greedy, one request at a time. Per workload and round: the decode rate of each (output tokens /
time, with the prompt already in the radix cache, streamed and timed from the first token on,
so prefill drops out), then the ratio; the table gives the median ratio over rounds, both
rates' medians and the speculative engine's acceptance (accepted / drafted tokens) and tokens
per forward (emitted / (emitted - accepted): each forward emits one token plus the accepted
drafts).

Workloads: (a) copy-heavy: repeating a passage, editing code, quoting a retrieved passage,
filling a JSON record from a document; (b) free chat; (c) free chat asked again: the same
prompt once more with the first answer in the radix cache (an agent re-running a step), where
n-gram drafts come from the cache. Every other run starts from a flushed cache with only its
prompt cached, so earlier rounds' answers cannot draft for it. The outputs of the two engines
are compared too (they must be identical: speculation does not change greedy answers).

The target is `--model` (a GGUF path or a known model name, e.g. qwen2.5-coder-1.5b; default:
the default model). With `--algorithm draft` the draft model is `--draft-model-path` (a path or
name, e.g. qwen2.5-coder-0.5b; default: the target's own file, i.e. self-speculation),
optionally only its first `--draft-num-layers` layers and in `--draft-quantization`, choosing
its tokens among `--draft-vocab-size` ids (the server's `--speculative-draft-vocab-size`).

The "n-gram ceiling" column is what any n-gram drafter could reach on the plain answer
(`ngram_ceiling`: an oracle choosing the best earlier match at every step, same draft cap), in
tokens per forward: where it is below 2, the answer copies too little for n-gram drafts to
double the decode rate.

With llama.cpp's `llama-server` found (`--llama-server PATH`, else the best configuration for
the host that `benchmarks/build_llama_cpp.sh` built, else on PATH; its build is printed under the
table), the same rounds also run it on the same GGUF and prompts,
one slot, greedy, prompt cached: without speculation and with each of its n-gram draft types in
`LLAMA_SPEC` (its decode rate is its own `timings.predicted_per_second`, which excludes the
prompt), each server restarted before each round so that it drafts only from the request's own
text, as sglite does (`ngram-mod` otherwise drafts the earlier rounds' answers). With
`--algorithm draft` and a draft model file, llama.cpp runs that same pair instead
(`-md <draft> --spec-type draft-simple`, drafting up to `--num-draft-tokens` and up to its
default 3); a configuration whose timings show no drafted token says so in the table. The
table shows its plain rate, the n-gram ceiling of its own plain answer (its kernels round
activations to 8 bits, so its greedy text can differ from sglite's) and its best speculative
configuration per workload. A llama-server that crashes (at a start or during a round) is
dropped from the later rounds and reported: its cells say "crashed at start-up (exit -11
SIGSEGV, log: PATH)" and the lines under the table give every configuration's status.

With `--concurrency N` (N > 1) a second table follows: each workload's prompt sent N times at
once (a batch of N decoding requests, each drafting from its own text), both engines alternated
round by round; its rates are the N requests' output tokens from the moment all have their
first token to the last one's end (prefill, and a draft model's passes over the prompts with
it, drop out).

Run: python -m benchmarks.bench_spec [--model M] [--rounds 3] [--tokens 96] [--quantization auto]
     [--algorithm ngram|draft] [--draft-model-path P] [--draft-quantization Q]
     [--draft-num-layers N] [--draft-vocab-size N] [--no-llama] [--workloads NAME_PREFIX ...]
     [--concurrency N]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import sglite
from benchmarks.common import (
    PeerCrashed,
    add_llama_server_option,
    make_parser,
    markdown_table,
    wait_settled,
)
from benchmarks.runners.llama_cpp import llama_failure
from benchmarks.spec_llama_peer import Peers, start_llama
from benchmarks.spec_measure import Tally, batch_run, decode_run, ngram_ceiling
from benchmarks.spec_table import WorkloadResult, print_table
from benchmarks.spec_workloads import REASKED, WORKLOADS
from sglite.runtime.server_args import ServerArgs


def run_concurrent(
    args: argparse.Namespace, plain: sglite.Engine, spec: sglite.Engine, names: list[str]
) -> list[list[str]]:
    """The `--concurrency` table's rows: per workload, both engines alternated `args.rounds`
    times on a batch of `args.concurrency` copies of its prompt."""
    rows = []
    for name in names:
        off, on, ratios, same = Tally(), Tally(), [], True
        prompt, n = WORKLOADS[name], args.concurrency
        for _ in range(args.rounds):
            rate_off, _, answers = batch_run(plain, prompt, args.tokens, n)
            rate_on, metas, ids_on = batch_run(spec, prompt, args.tokens, n)
            off.rates.append(rate_off)
            on.rates.append(rate_on)
            on.drafted += sum(meta["spec_draft_tokens"] for meta in metas)
            on.accepted += sum(meta["spec_accepted_tokens"] for meta in metas)
            ratios.append(rate_on / rate_off)
            same = same and ids_on == answers
        ratio = statistics.median(ratios)
        print(f"  {name}, {n} at once: {ratio:.2f}x {rounds_text(ratios)}", flush=True)
        rows.append(
            [
                name, f"{off.rate:.1f}", f"{on.rate:.1f}", f"{ratio:.2f}x", on.acceptance,
                "yes" if same else "NO",
            ]
        )  # fmt: skip
    return rows


def rounds_text(ratios: list[float]) -> str:
    """Each round's speedup, in order (how far the median's rounds spread)."""
    return "(rounds " + ", ".join(f"{r:.2f}" for r in ratios) + ")"


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
        spec["speculative_draft_vocab_size"] = args.draft_vocab_size
    return spec


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = make_parser(__doc__)
    parser.add_argument("--model", default=None, help="target GGUF path or known model name")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--num-draft-tokens", type=int, default=ServerArgs.speculative_num_draft_tokens
    )
    parser.add_argument("--algorithm", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft-model-path", default=None)
    parser.add_argument("--draft-quantization", default="auto")
    parser.add_argument("--draft-num-layers", type=int, default=None)
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=ServerArgs.speculative_draft_vocab_size,
        help="ids the draft model chooses among (0: its whole vocabulary)",
    )
    add_llama_server_option(parser)
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument(
        "--workloads", nargs="*", default=None, help="names (or name prefixes) of workloads to run"
    )
    parser.add_argument(
        "--concurrency", type=int, default=1, help="also each workload N requests at once"
    )
    return parser.parse_args()


def main() -> None:
    """Alternate the engines (and llama-servers) per workload and round; print the table."""
    args = parse_args()
    common = {
        "model_path": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "log_level": "error",
    }
    plain = sglite.Engine(**common)
    spec = sglite.Engine(**common, **speculation_args(args, plain))
    for engine in (plain, spec):
        wait_settled(engine.get_server_info)
    info = spec.get_server_info()
    print(f"model {info['model_path']}, {info['dtype']}, weights {info['weight_layouts']}, ")
    print(f"kernels {info['kernel_isa'] or 'portable C'}, torch threads {torch.get_num_threads()}")
    group = info["speculative_verify_row_group"]
    print(
        f"drafts sized for verification rows in groups of {group}"
        if group > 1
        else "drafts sized for verification rows that each cost about alike (group 1)"
    )
    if args.algorithm == "draft":
        draft = info["speculative_draft"]
        print(
            f"draft model {draft['model_path']}, weights {draft['quantization']}, "
            f"{draft['num_layers']} layers"
        )
    llama = start_llama(args, info["model_path"])
    names = [
        name
        for name in WORKLOADS
        if not args.workloads or any(name.startswith(w) for w in args.workloads)
    ]
    rows, concurrent = [], []
    try:
        for name in names:
            rows.append(run_workload(args, plain, spec, llama, name, name in REASKED))
            print(f"  {name}: {rows[-1].ratio:.2f}x {rounds_text(rows[-1].ratios)}", flush=True)
        if args.concurrency > 1:
            batch_names = [name for name in names if name not in REASKED]
            concurrent = run_concurrent(args, plain, spec, batch_names)
    finally:
        plain.shutdown()
        spec.shutdown()
        llama.close()
    print_table(args, rows, llama)
    if concurrent:
        heads = [
            "workload", f"off, {args.concurrency} at once (tok/s)", f"{args.algorithm} (tok/s)",
            "speedup (median)", "acceptance", "same output",
        ]  # fmt: skip
        print("\n" + markdown_table(heads, concurrent, {1, 2, 3, 4}, pad=False))


def run_workload(
    args: argparse.Namespace,
    plain: sglite.Engine,
    spec: sglite.Engine,
    llama: Peers,
    name: str,
    reask: bool,
) -> WorkloadResult:
    """Alternate sglite without and with speculation and each llama-server, `args.rounds`
    times; every llama-server is restarted before its round (see `LlamaServer`), and one that
    crashes is dropped (`Peers.failed`)."""
    prompt = WORKLOADS[name]
    off, on, ratios, emitted, same = Tally(), Tally(), [], 0, True
    peers = {peer: Tally() for peer in llama.servers}
    answer: list[int] = []
    peer_answer: list[int] = []  # llama.cpp's, without speculation
    for _ in range(args.rounds):
        rate_off, _, answer = decode_run(plain, prompt, args.tokens, reask)
        rate_on, meta, ids_on = decode_run(spec, prompt, args.tokens, reask)
        off.rates.append(rate_off)
        on.rates.append(rate_on)
        ratios.append(rate_on / rate_off)
        on.drafted += meta["spec_draft_tokens"]
        on.accepted += meta["spec_accepted_tokens"]
        emitted += meta["completion_tokens"]
        same = same and ids_on == answer
        for peer, server in list(llama.servers.items()):
            try:
                server.restart()
                rate, drafted, accepted, ids = server.decode_run(prompt, args.tokens, reask)
            except (PeerCrashed, OSError, ValueError, KeyError) as exc:
                status = llama_failure(server.binary, server.proc, server.log.name, exc)
                llama.failed(peer, status)
                continue
            if peer == "off":
                peer_answer = ids
            peers[peer].rates.append(rate)
            peers[peer].drafted += drafted
            peers[peer].accepted += accepted
    context = plain.tokenizer.encode(prompt)
    result = WorkloadResult(
        name,
        off,
        on,
        statistics.median(ratios),
        ratios,
        emitted / max(emitted - on.accepted, 1),
        same,
        None if reask else ngram_ceiling(context, answer, args.num_draft_tokens),
    )
    measured = {peer: tally for peer, tally in peers.items() if tally.rates}
    spec_peers = [peer for peer in measured if peer != "off"]
    if "off" in measured and spec_peers:
        best = max(spec_peers, key=lambda p: measured[p].rate)
        result.peer_off, result.peer = measured["off"], (best, measured[best])
        if not reask and peer_answer:
            result.peer_ceiling = ngram_ceiling(context, peer_answer, args.num_draft_tokens)
    return result


if __name__ == "__main__":
    main()
