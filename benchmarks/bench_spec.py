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
round by round; its rates are all N requests' output tokens over the batch's time, with a
1-token run of the same batch subtracted (prefill drops out).

Run: python -m benchmarks.bench_spec [--model M] [--rounds 3] [--tokens 96] [--quantization auto]
     [--algorithm ngram|draft] [--draft-model-path P] [--draft-quantization Q]
     [--draft-num-layers N] [--draft-vocab-size N] [--no-llama] [--workloads NAME_PREFIX ...]
     [--concurrency N]
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
from benchmarks.common import (
    PeerCrashed,
    PeerStatus,
    add_llama_server_option,
    make_parser,
    markdown_table,
    post_json,
)
from benchmarks.runners.llama_cpp import (
    find_llama_server,
    llama_build_line,
    llama_failure,
    llama_version,
    start_llama_server,
)
from sglite.runtime.model.catalog import resolve_model_path
from sglite.runtime.server_args import ServerArgs

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


def batch_run(
    engine: sglite.Engine, prompt: str, tokens: int, n: int = 1, reask: bool = False
) -> tuple[float, list[dict], list[list[int]]]:
    """(decode tok/s of all `n` copies of `prompt` run at once, each run's meta_info, each
    answer's ids) from a flushed cache with the prompt cached beforehand (with `reask`, the
    whole answer too), by a request that decodes a token, so that a draft model, which reads
    a prompt as the target prefills it, caches it too, as after a conversation's earlier
    turn. The time of the same batch writing one token is subtracted, so prefill drops out."""
    params = {"temperature": 0, "max_new_tokens": 1}
    engine.flush_cache()
    engine.generate(prompt, {**params, "max_new_tokens": tokens if reask else 2})
    start = time.perf_counter()
    engine.generate([prompt] * n, [params] * n)
    first = time.perf_counter() - start
    start = time.perf_counter()
    outs = engine.generate([prompt] * n, [{**params, "max_new_tokens": tokens}] * n)
    total = time.perf_counter() - start
    done = sum(out["meta_info"]["completion_tokens"] - 1 for out in outs)
    metas = [out["meta_info"] for out in outs]
    return done / max(total - first, 1e-9), metas, [out["output_ids"] for out in outs]


def decode_run(
    engine: sglite.Engine, prompt: str, tokens: int, reask: bool
) -> tuple[float, dict, list]:
    """`batch_run` of one request: (decode tok/s, its meta_info, its output ids)."""
    rate, metas, ids = batch_run(engine, prompt, tokens, 1, reask)
    return rate, metas[0], ids[0]


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
        print(f"  {name}, {args.concurrency} at once: {ratio:.2f}x", flush=True)
        rows.append(
            [
                name, f"{off.rate:.1f}", f"{on.rate:.1f}", f"{ratio:.2f}x", on.acceptance,
                "yes" if same else "NO",
            ]
        )  # fmt: skip
    return rows


class LlamaServer:
    """One llama-server (one slot) on the default GGUF with the given speculative flags.

    Some of its draft types keep what they learned across requests (`ngram-mod`'s n-gram pool
    outlives the request), so a round that asks the same prompt again would draft the earlier
    rounds' answer: `restart` gives every round a server that has seen only its prompt, as
    sglite's runs start from a flushed cache."""

    def __init__(self, binary: str, model_path: str, threads: int, extra: tuple[str, ...]):
        self.binary, self.model_path, self.threads, self.extra = binary, model_path, threads, extra
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.restart()

    def restart(self) -> None:
        """Stop the server (if running) and start a fresh one, waiting until it answers."""
        self.close()
        self.proc, self.base = start_llama_server(
            self.binary, self.model_path, self.threads, 1, 4096, self.log, self.extra
        )

    def decode_run(self, prompt: str, tokens: int, reask: bool) -> tuple[float, int, int, list]:
        """(decode tok/s, drafted, accepted, output ids) with the prompt cached beforehand
        (with `reask`, after a full run of the same request, as `decode_run` does for sglite)."""
        body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": True}
        post_json(self.base + "/completion", body if reask else {**body, "n_predict": 1})
        out = post_json(self.base + "/completion", {**body, "return_tokens": True})
        timings = out["timings"]
        return (
            timings["predicted_per_second"],
            timings.get("draft_n", 0),
            timings.get("draft_n_accepted", 0),
            out.get("tokens", []),
        )

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def ngram_ceiling(context: list[int], answer: list[int], cap: int) -> float:
    """Tokens per forward that an oracle n-gram drafter would reach on `answer`: at every step
    it drafts, from any earlier position of `context + answer so far`, the continuation that
    matches the most of what the model writes next (up to `cap` tokens). No drafter that copies
    from the request's own text does better, so below 2 the answer copies too little for n-gram
    speculation to double the decode rate, whatever the lookup rule."""
    forwards, done = 0, 0
    while done < len(answer):
        seen, upcoming = context + answer[:done], answer[done : done + cap]
        best = 0
        for start in range(len(seen)):
            n = 0
            while n < len(upcoming) and start + n < len(seen) and seen[start + n] == upcoming[n]:
                n += 1
            best = max(best, n)
        done += best + 1  # the accepted draft and the model's own next token
        forwards += 1
    return len(answer) / max(forwards, 1)


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


@dataclass
class Peers:
    """llama.cpp's servers by configuration ("off" and the speculative ones) and how each fared
    (a configuration that crashed has a status and no server from then on)."""

    servers: dict[str, LlamaServer] = field(default_factory=dict)
    status: dict[str, PeerStatus] = field(default_factory=dict)
    about: str = ""  # the binary, its version and build

    def failed(self, config: str, status: PeerStatus) -> None:
        """Drop `config`'s server, keeping why."""
        server = self.servers.pop(config, None)
        if server is not None:
            server.close()
        status.name, status.build = f"llama.cpp {config}", ""  # `about` names the build
        self.status[config] = status
        print(f"  {status.line()}", flush=True)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()

    def summary(self) -> list[str]:
        """The lines under the table: the build, then each configuration's status."""
        if not self.status:
            return []
        return [self.about, *(f"- {s.line()}" for s in self.status.values())]


def start_llama(args: argparse.Namespace, model_path: str) -> Peers:
    """llama-server without speculation ("off") and with each `LLAMA_SPEC` configuration; one
    that crashes at start-up is recorded, not raised."""
    peers = Peers()
    if args.no_llama:
        return peers
    binary, why = find_llama_server(args.llama_server)
    if binary is None:
        print(f"llama.cpp skipped: {why}")
        return peers
    peers.about = (
        f"llama.cpp {llama_version(binary)} ({why}): {binary}; build: {llama_build_line(binary)}"
    )
    print(peers.about, flush=True)
    threads = torch.get_num_threads()
    configs = {"off": (), **llama_speculation(args, threads)}
    for name, cfg in configs.items():
        try:
            peers.servers[name] = LlamaServer(binary, model_path, threads, cfg)
            peers.status[name] = PeerStatus(f"llama.cpp {name}")
        except PeerCrashed as exc:
            peers.failed(name, exc.status)
    return peers


def llama_speculation(args: argparse.Namespace, threads: int) -> dict[str, tuple[str, ...]]:
    """llama-server's speculative configurations to compare: with a draft model, that model
    (at sglite's draft length and at llama.cpp's default 3); else its n-gram types."""
    if args.algorithm != "draft" or args.draft_model_path is None:
        return dict(LLAMA_SPEC)
    draft = resolve_model_path(args.draft_model_path)
    base = ("-md", draft, "--spec-type", "draft-simple", "-td", str(threads), "-ngld", "0")
    return {
        f"draft model, n-max {args.num_draft_tokens}": (
            *base, "--spec-draft-n-max", str(args.num_draft_tokens)
        ),
        "draft model, n-max 3": (*base, "--spec-draft-n-max", "3"),
    }  # fmt: skip


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
    names = [
        name
        for name in WORKLOADS
        if not args.workloads or any(name.startswith(w) for w in args.workloads)
    ]
    rows, concurrent = [], []
    try:
        for name in names:
            rows.append(run_workload(args, plain, spec, llama, name, name in REASKED))
            print(f"  {name}: {rows[-1].ratio:.2f}x", flush=True)
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


@dataclass
class WorkloadResult:
    """One workload's row of the table."""

    name: str
    off: Tally
    on: Tally
    ratio: float  # median over rounds of speculative / plain rate
    per_forward: float  # tokens emitted per forward with speculation
    same: bool  # identical outputs with and without speculation, every round
    ceiling: float | None  # `ngram_ceiling` of the plain answer (None: drafts from the cache)
    peer_off: Tally | None = None  # llama.cpp without speculation
    peer_ceiling: float | None = None  # `ngram_ceiling` of llama.cpp's plain answer
    peer: tuple[str, Tally] | None = None  # llama.cpp's best n-gram configuration


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


def print_table(args: argparse.Namespace, rows: list[WorkloadResult], llama: Peers) -> None:
    """Markdown table, one row per workload; llama.cpp's columns when it was run (its status
    where it crashed), its build and each configuration's status under the table."""
    with_llama = bool(llama.status)
    heads = [
        "workload", "off (tok/s)", f"{args.algorithm} (tok/s)", "speedup (median)", "acceptance",
        "tokens per forward", "n-gram ceiling", "same output",
    ]  # fmt: skip
    right = {1, 2, 3, 4, 5, 6}
    if with_llama:
        heads += [
            "llama.cpp off", "llama.cpp's n-gram ceiling",
            "llama.cpp best speculation (tok/s, config, acceptance)", "vs llama.cpp's best",
        ]  # fmt: skip
        right |= {8, 9, 11}
    why = "; ".join(f"{s.name} {s.cell()}" for s in llama.status.values() if not s.ok)
    cells = [row_cells(row, len(heads), why) for row in rows]
    print("\n" + markdown_table(heads, cells, right, pad=False))
    for line in llama.summary():
        print(line)


def row_cells(row: WorkloadResult, width: int, peer_status: str = "") -> list[str]:
    """One workload's cells, `width` in all: llama.cpp's when it ran, else `peer_status` (why
    not: its crashes)."""
    ceiling = "-" if row.ceiling is None else f"{row.ceiling:.2f}"
    cells = [
        row.name, f"{row.off.rate:.1f}", f"{row.on.rate:.1f}", f"{row.ratio:.2f}x",
        row.on.acceptance, f"{row.per_forward:.2f}", ceiling, "yes" if row.same else "NO",
    ]  # fmt: skip
    if row.peer is not None and row.peer_off is not None:
        config, best = row.peer
        peer_ceiling = "-" if row.peer_ceiling is None else f"{row.peer_ceiling:.2f}"
        drafted = best.acceptance if best.drafted else "drafted nothing"
        cells += [
            f"{row.peer_off.rate:.1f}", peer_ceiling, f"{best.rate:.1f} ({config}, {drafted})",
            f"{row.on.rate / best.rate:.2f}x",
        ]  # fmt: skip
    elif peer_status and len(cells) < width:
        cells.append(peer_status)
    return cells + ["-"] * (width - len(cells))


if __name__ == "__main__":
    main()
