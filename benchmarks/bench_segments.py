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
import time

from benchmarks.segments_passes import Config, run_config
from benchmarks.segments_report import report
from benchmarks.segments_workload import Workload, make_docs, make_requests


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
