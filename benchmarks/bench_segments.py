"""Reusable prompt segments on a RAG workload: TTFT, throughput and answer quality against
exact-prefix caching, no caching and a full prefill.

Workload: a pool of `--passages` documents, each the rag workload's four retrieved passages about
one fictional company (`benchmarks/programs/rag.py`, about 135 tokens; companies with distinct
names). Each request takes 4-6 documents, sampled without replacement, and asks one of the rag
workload's questions about one of them. Prompt = "Answer from the documents.\\n" + the documents
+ "Question: ...\\nAnswer:", plain completion. Every piece is tokenized alone (the header with
`tokenizer.encode`, the rest with `tokenizer.hf.encode(..., add_special_tokens=False)`, as
tests/test_segments.py does), so every configuration gets the same token ids; the documents'
token spans are the segments.

Orders: each request has a fixed document set and question, and two seeded orders of its
documents. The warm-up pass sends every request once in the first order (so every document has
been seen: its segment is cached, and exact-prefix caching holds the warm-up prompts); the
measured passes send them in the second order (always different from the first for 2+ documents),
so exact-prefix caching gets no free repeat of a whole prompt, only what a shared beginning
(header, maybe the first document) gives it.

Configurations, one engine each (default model or `--model-path`, `--dtype`, float32 unless
given: in bfloat16 the reference itself moves with batch and cache), started one at a
time and shut down before the next: "no cache" (`disable_radix_cache=True`), "exact prefix"
(radix cache, no segments), and "segments f" (radix cache, segments,
`segment_recompute_fraction=f`) for each f in `--fractions`. Per configuration:
1. warm-up pass (the whole list as one batch, 1 output token, first order);
2. TTFT: each request alone (batch 1), greedy, `max_new_tokens=1`, second order; latency of
   `generate`, p50 and mean;
3. flush the cache, the warm-up pass again (so the TTFT pass's prompts give exact-prefix caching
   nothing), then throughput: the whole list as one batch, greedy, `--answer-tokens` tokens,
   `top_logprobs_num=20`, second order; requests / wall time. Its outputs give the quality.
After each warm-up the benchmark waits until the scheduler is idle: internal segment-fill
requests queued by a segmented batch can outlive its answers (reported on stderr).

Quality, against the "exact prefix" configuration's answers from step 3 (a radix hit is
bit-for-bit a full prefill's KV, so these are the full-prefill answers):
- answer match: the share of requests whose greedy output ids are identical;
- token agreement: per request, (tokens equal position by position up to the first mismatch) /
  (the longer answer's length), mean over requests;
- first-token KL: KL(reference || configuration) of the first output token's distribution,
  approximated over its top 20: on the union of both top-20 token sets, a token missing from one
  side's top 20 gets that side's 20th probability (an upper bound on its true one), and each side
  is renormalized over the union; mean over requests;
- KL <=k: the same, averaged over the first `--kl-tokens` output positions but only while both
  answers so far are identical (position i counts if the first i tokens agree: the two
  distributions are then conditioned on the same text), so never fewer than the first position.
The "no cache" row is a control: its answers must match too (up to float noise of batching).

Token counts per request (TTFT pass, mean): reused = KV copied from segments (for non-segment
configurations: the exact-prefix hit), recomputed = segment tokens computed again, computed =
other tokens computed. The final line names the lowest fraction whose answers match the reference
on >= 95% of requests and its TTFT (p50) speedup over exact-prefix caching; the target is >= 2x.

`--selections once,layerwise` runs each fraction strictly between 0 and 1 once per selection
(`--segment-selection`: chosen after layer 1, or narrowed after every layer at the same cost).

Run: python -m benchmarks.bench_segments [--requests 40] [--fractions 0.0,0.1,0.25,0.5,1.0]
     [--answer-tokens 16] [--kl-tokens 4] [--passages 12] [--seed 0] [--model-path P]
     [--selections once,layerwise]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import sglite
from benchmarks.common import command_line
from benchmarks.host import cpu_line
from benchmarks.programs.common import rng_for
from benchmarks.programs.rag import QUESTIONS, company_facts, company_passages

HEADER = "Answer from the documents.\n"
TOP_K = 20
TARGET_MATCH = 0.95
TARGET_SPEEDUP = 2.0


@dataclass(frozen=True)
class Request:
    """One question about one of its documents, with its documents in two orders."""

    docs_warm: tuple[int, ...]
    docs_measured: tuple[int, ...]
    question: str


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    spans: list[list[int]]  # the documents' token spans [start, end)


@dataclass(frozen=True)
class Config:
    name: str
    engine_kwargs: dict[str, Any]
    fraction: float | None = None  # None: no segments sent

    @property
    def segmented(self) -> bool:
        return self.fraction is not None


@dataclass
class Outcome:
    """What one configuration measured."""

    config: Config
    ttft_ms: list[float]
    throughput: float
    counts: list[dict[str, int]]  # reused / recomputed / computed per request (TTFT pass)
    answers: list[list[int]]
    top_logprobs: list[list[list]]  # per request, per output position: top-20 entries


@dataclass
class Quality:
    answer_match: float
    token_agreement: float
    first_kl: float
    kl_k: float


@dataclass
class Workload:
    docs: list[str]
    requests: list[Request]
    warm: list[Prompt] = field(default_factory=list)
    measured: list[Prompt] = field(default_factory=list)

    def tokenize(self, tok: Any) -> None:
        """The prompts' ids (once: every configuration runs the same model and tokenizer)."""
        if self.measured:
            return
        for r in self.requests:
            self.warm.append(build_prompt(tok, self.docs, r.docs_warm, r.question))
            self.measured.append(build_prompt(tok, self.docs, r.docs_measured, r.question))


# ---------------------------------------------------------------------------- workload
def make_docs(num: int, seed: int) -> tuple[list[str], list[dict[str, Any]]]:
    """`num` documents about companies with distinct names (the rag workload's generator)."""
    docs, companies, names = [], [], set()
    group = 0
    while len(docs) < num:
        company = company_facts(seed, group)
        group += 1
        if company["name"] in names:
            continue
        names.add(company["name"])
        companies.append(company)
        docs.append(company_passages(company))
    return docs, companies


def make_requests(num: int, companies: list[dict[str, Any]], seed: int) -> list[Request]:
    """Each request: 4-6 documents without replacement, a question about one, two orders."""
    requests = []
    for i in range(num):
        rng = rng_for(seed, "segments-request", i)
        chosen = rng.sample(range(len(companies)), rng.randint(4, min(6, len(companies))))
        template, _ = rng.choice(QUESTIONS)
        question = template.format(**companies[rng.choice(chosen)])
        measured = list(chosen)
        while measured == chosen and len(chosen) > 1:
            rng.shuffle(measured)
        requests.append(Request(tuple(chosen), tuple(measured), question))
    return requests


def build_prompt(tok: Any, docs: list[str], order: tuple[int, ...], question: str) -> Prompt:
    """Token ids of header + documents + question, each piece tokenized alone."""
    pieces = [tok.encode(HEADER)]
    pieces += [tok.hf.encode(docs[i], add_special_tokens=False) for i in order]
    pieces.append(tok.hf.encode(f"Question: {question}\nAnswer:", add_special_tokens=False))
    ids: list[int] = []
    spans = []
    for i, piece in enumerate(pieces):
        if 0 < i < len(pieces) - 1:
            spans.append([len(ids), len(ids) + len(piece)])
        ids += piece
    return Prompt(ids, spans)


# ---------------------------------------------------------------------------- passes
def send(
    engine: sglite.Engine, cfg: Config, prompts: list[Prompt], params: dict, **kw: Any
) -> list[dict]:
    """One batch: the prompts' ids, with their segments when the configuration uses them."""
    segments = [p.spans for p in prompts] if cfg.segmented else None
    return engine.generate(
        input_ids=[p.ids for p in prompts],
        sampling_params=[dict(params) for _ in prompts],
        segments=segments,
        **kw,
    )


def token_counts(prompt: Prompt, meta: dict) -> dict[str, int]:
    """reused / recomputed / computed prompt tokens (a plain request: its exact-prefix hit)."""
    if "segment_tokens" in meta:
        return dict(meta["segment_tokens"])
    cached = meta.get("cached_tokens", 0)
    return {"reused": cached, "recomputed": 0, "computed": len(prompt.ids) - cached}


def ttft_pass(
    engine: sglite.Engine, cfg: Config, prompts: list[Prompt]
) -> tuple[list[float], list[dict[str, int]]]:
    """Each prompt alone, one greedy token: latency (ms) and token counts."""
    times, counts = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = send(engine, cfg, [prompt], {"max_new_tokens": 1, "temperature": 0})[0]
        times.append(1000 * (time.perf_counter() - start))
        counts.append(token_counts(prompt, out["meta_info"]))
    return times, counts


def wait_idle(engine: sglite.Engine, name: str, stage: str) -> None:
    """Wait until the scheduler has nothing queued or running. After a segmented batch returns,
    internal segment-fill requests may still be queued; left there, they would be computed
    inside a measured request's time. A wait is reported on stderr."""
    start = time.perf_counter()
    for _ in range(3000):
        info = engine.get_server_info()
        if not info.get("num_running_reqs") and not info.get("num_queued_reqs"):
            break
        time.sleep(0.02)
    waited = time.perf_counter() - start
    if waited > 0.01:
        print(f"[{name}] {stage}: scheduler busy for {waited:.2f} s after it", file=sys.stderr)


def flush(engine: sglite.Engine, name: str) -> None:
    """Flush the cache, waiting while the scheduler still has work after every answer was
    returned (it refuses to flush then); a refusal is reported on stderr."""
    for attempt in range(600):
        try:
            engine.flush_cache()
            return
        except RuntimeError as exc:
            if "cannot flush" not in str(exc):
                raise
            if attempt == 0:
                info = engine.get_server_info()
                queues = {k: info.get(k) for k in ("num_running_reqs", "num_queued_reqs")}
                print(f"[{name}] flush refused, no request in flight: {queues}", file=sys.stderr)
            time.sleep(0.1)
    raise RuntimeError(f"[{name}] the scheduler never became idle: cannot flush")


def run_config(cfg: Config, work: Workload, args: argparse.Namespace) -> Outcome:
    model = {"model_path": args.model_path} if args.model_path else {}
    engine = sglite.Engine(dtype=args.dtype, log_level="error", **model, **cfg.engine_kwargs)
    warm_params = {"max_new_tokens": 1, "temperature": 0}
    answer_params = {"max_new_tokens": args.answer_tokens, "temperature": 0}
    try:
        work.tokenize(engine.tokenizer)
        send(engine, cfg, work.warm, warm_params)
        wait_idle(engine, cfg.name, "warm-up")
        ttft, counts = ttft_pass(engine, cfg, work.measured)
        wait_idle(engine, cfg.name, "TTFT pass")
        flush(engine, cfg.name)
        send(engine, cfg, work.warm, warm_params)
        wait_idle(engine, cfg.name, "second warm-up")
        start = time.perf_counter()
        outs = send(
            engine, cfg, work.measured, answer_params, return_logprob=True, top_logprobs_num=TOP_K
        )
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    return Outcome(
        cfg,
        ttft,
        len(outs) / seconds,
        counts,
        [list(o["output_ids"]) for o in outs],
        [o["meta_info"]["output_top_logprobs"] for o in outs],
    )


# ---------------------------------------------------------------------------- quality
def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def top_kl(ref: list, got: list) -> float:
    """KL(ref || got) over the union of two top-k lists ([logprob, token_id, text] entries); a
    token missing from one side gets that side's smallest listed probability."""
    p = {int(tid): lp for lp, tid, *_ in ref}
    q = {int(tid): lp for lp, tid, *_ in got}
    union = p.keys() | q.keys()
    pv = {t: math.exp(p.get(t, min(p.values()))) for t in union}
    qv = {t: math.exp(q.get(t, min(q.values()))) for t in union}
    p_sum, q_sum = sum(pv.values()), sum(qv.values())
    return sum(pv[t] / p_sum * (math.log(pv[t] / p_sum) - math.log(qv[t] / q_sum)) for t in union)


def quality(ref: Outcome, got: Outcome, kl_tokens: int) -> Quality:
    matches, agreements, first, kl_k = [], [], [], []
    for r_ids, g_ids, r_top, g_top in zip(
        ref.answers, got.answers, ref.top_logprobs, got.top_logprobs, strict=True
    ):
        agree = common_prefix(r_ids, g_ids)
        matches.append(r_ids == g_ids)
        agreements.append(agree / max(len(r_ids), len(g_ids), 1))
        valid = min(kl_tokens, agree + 1, len(r_top), len(g_top))
        kls = [top_kl(r_top[i], g_top[i]) for i in range(valid)]
        first.append(kls[0] if kls else float("nan"))
        kl_k.append(statistics.fmean(kls) if kls else float("nan"))
    return Quality(
        statistics.fmean(matches),
        statistics.fmean(agreements),
        statistics.fmean(first),
        statistics.fmean(kl_k),
    )


# ---------------------------------------------------------------------------- report


def row(o: Outcome, base_p50: float, q: Quality) -> str:
    p50, mean = statistics.median(o.ttft_ms), statistics.fmean(o.ttft_ms)
    counts = "/".join(
        f"{statistics.fmean(c[k] for c in o.counts):.0f}"
        for k in ("reused", "recomputed", "computed")
    )
    return (
        f"| {o.config.name} | {p50:.0f} | {mean:.0f} | {base_p50 / p50:.2f}x "
        f"| {o.throughput:.2f} | {q.answer_match:.0%} | {q.token_agreement:.0%} "
        f"| {q.first_kl:.4f} | {q.kl_k:.4f} | {counts} |"
    )


def verdict(outcomes: list[Outcome], qualities: list[Quality], base_p50: float) -> str:
    passing = sorted(
        (o.config.fraction, statistics.median(o.ttft_ms))
        for o, q in zip(outcomes, qualities)
        if o.config.segmented and q.answer_match >= TARGET_MATCH
    )
    if not passing:
        return f"no recompute fraction reaches {TARGET_MATCH:.0%} answer match: target not met"
    fraction, p50 = passing[0]
    speedup = base_p50 / p50
    met = "target met" if speedup >= TARGET_SPEEDUP else "target not met"
    return (
        f"lowest fraction with >= {TARGET_MATCH:.0%} answer match: {fraction:g}, TTFT p50 "
        f"{speedup:.2f}x lower than exact-prefix caching (target >= {TARGET_SPEEDUP:g}x): {met}"
    )


def report(outcomes: list[Outcome], work: Workload, args: argparse.Namespace) -> None:
    ref = next(o for o in outcomes if o.config.name == "exact prefix")
    base_p50 = statistics.median(ref.ttft_ms)
    qualities = [quality(ref, o, args.kl_tokens) for o in outcomes]
    prompt_tokens = statistics.fmean(len(p.ids) for p in work.measured)
    doc_tokens = statistics.fmean(e - s for p in work.measured for s, e in p.spans)
    print(f"host: {cpu_line()}; torch threads {torch.get_num_threads()}")
    print("command: " + command_line("benchmarks.bench_segments"))
    print(
        f"{len(work.requests)} requests, {len(work.docs)} documents of {doc_tokens:.0f} tokens "
        f"(mean), prompts of {prompt_tokens:.0f} tokens (mean); "
        f"{os.path.basename(args.model_path) if args.model_path else 'default model'}, "
        f"{args.dtype}; "
        f"{args.answer_tokens} answer tokens; reference = exact prefix (full prefill)"
    )
    print(
        f"\n| configuration | TTFT p50 ms | TTFT mean ms | TTFT vs exact prefix | throughput "
        f"req/s | answer match | token agreement | first-token KL | KL <={args.kl_tokens} tokens "
        "| reused/recomputed/computed tokens per request |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for o, q in zip(outcomes, qualities):
        print(row(o, base_p50, q))
    print("\n" + verdict(outcomes, qualities, base_p50))


def configs(fractions: list[float], selections: list[str]) -> list[Config]:
    plain = [
        Config("no cache", {"disable_radix_cache": True}),
        Config("exact prefix", {}),
    ]
    named = len(selections) > 1 or selections != ["once"]
    return plain + [
        Config(
            f"segments {f:g}" + (f" {sel}" if named and 0 < f < 1 else ""),
            {"segment_recompute_fraction": f, "segment_selection": sel},
            fraction=f,
        )
        for f in fractions
        for sel in (selections if 0 < f < 1 else selections[:1])  # 0 and 1 choose nothing
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--fractions", default="0.0,0.1,0.25,0.5,1.0")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--kl-tokens", type=int, default=4)
    parser.add_argument("--passages", type=int, default=12, help="documents in the pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--selections", default="once", help="segment selections to compare: once,layerwise"
    )
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument(
        "--model-path", default=None, help="a GGUF or model directory (default: the default model)"
    )
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    docs, companies = make_docs(args.passages, args.seed)
    work = Workload(docs, make_requests(args.requests, companies, args.seed))
    start = time.perf_counter()
    selections = [s.strip() for s in args.selections.split(",") if s.strip()]
    outcomes = [run_config(cfg, work, args) for cfg in configs(fractions, selections)]
    report(outcomes, work, args)
    print(f"run time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
