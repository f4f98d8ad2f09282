"""bench_spec's workloads through one speculative scheduler, each decode step priced by fixed
costs instead of timed: what the speculation policy's decisions are worth, without the host's
noise.

A shared host's step times drift by a fifth or more within seconds, more than most policy
changes move a speedup, so `bench_spec`'s alternated rounds cannot tell such changes apart.
Here the scheduler runs in-process (its own cost model still timing its steps, as served) over
bench_spec's workloads in bench_spec's order, batch 1 then `--concurrency`, `--rounds` times
each from a flushed cache with the prompt cached; each decode step of R requests verifying D
drafted tokens after P draft-model passes is priced `pass(R + D) + P * draft(R)`, where
`pass(n) = plain-ms + row-ms * (n - 1)` and `draft(R) = draft-ms + draft-row-ms * (R - 1)`
(defaults: the Qwen2.5-Coder 1.5B and 0.5B on host A, from `bench_pass_rows` and
`trace_speculation`), against `pass(R)` per token without speculation. `--pass-table
"1:39.6,2:45.8,..."` prices a pass by measured rows instead (`bench_pass_rows`' "as built"
column), linear between them and past the last by its last step: passes are not linear in
their rows (on AVX2 a fifth row costs a chunk of its own). The draft model's
prompt reads are left out (as bench_spec, timing from the first token on, leaves them out).
`--algorithm ngram`: n-gram drafts alone, no draft model.

Run: python -m benchmarks.bench_spec_priced [--model M] [--draft-model-path P | --algorithm
     ngram] [--rounds 2]
     [--concurrency 4] [--tokens 96] [--plain-ms 39.6] [--row-ms 14.5] [--draft-ms 14.0]
     [--draft-row-ms 6.6] [--pass-table ROWS:MS,...]
"""

from __future__ import annotations

import benchmarks.scheduler_env  # noqa: F401  (first: the scheduler's OpenMP setting)

# isort: split
import argparse

from benchmarks.profile_decode import settled_scheduler  # noqa: E402
from benchmarks.spec_workloads import REASKED, WORKLOADS  # noqa: E402
from benchmarks.trace_speculation import StepTracer, TracedStep, run_batch  # noqa: E402
from sglite.runtime.model.loader import load_model  # noqa: E402
from sglite.runtime.server_args import ServerArgs  # noqa: E402


def table_ms(table: dict[int, float], rows: int) -> float:
    """A pass of `rows` rows from measured passes (`table`: rows -> ms): linear between the two
    nearest, past the ends by the nearest end's step."""
    known = sorted(table)
    if rows in table:
        return table[rows]
    below = [r for r in known if r < rows]
    above = [r for r in known if r > rows]
    if below and above:
        lo, hi = below[-1], above[0]
    elif below:
        lo, hi = known[-2], known[-1]
    else:
        lo, hi = known[0], known[1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return table[lo] + slope * (rows - lo)


def parse_table(text: str) -> dict[int, float]:
    """ "1:39.6,2:45.8" -> {1: 39.6, 2: 45.8} (at least two row counts)."""
    table = {int(rows): float(ms) for rows, ms in (item.split(":") for item in text.split(","))}
    if len(table) < 2:
        raise ValueError(f"--pass-table needs at least two row counts, got {text!r}")
    return table


def priced_speedup(steps: list[TracedStep], batch: int, args: argparse.Namespace) -> float:
    """Plain decoding's priced milliseconds for the tokens `steps` emitted over theirs."""

    def pass_ms(rows: int) -> float:
        if args.pass_table is not None:
            return table_ms(args.pass_table, rows)
        return args.plain_ms + args.row_ms * (rows - 1)

    def draft_ms(reqs: int) -> float:
        return args.draft_ms + args.draft_row_ms * (reqs - 1)

    spent = sum(
        pass_ms(s.running + s.drafted) + s.draft_passes * draft_ms(s.running) for s in steps
    )
    emitted = sum(s.running + s.accepted for s in steps)
    return emitted / batch * pass_ms(batch) / spent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model-path", default="qwen2.5-coder-0.5b")
    parser.add_argument(
        "--algorithm", choices=("draft", "ngram"), default="draft", help="ngram: no draft model"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--plain-ms", type=float, default=39.6, help="a one-row pass")
    parser.add_argument("--row-ms", type=float, default=14.5, help="each further row")
    parser.add_argument("--draft-ms", type=float, default=14.0, help="a draft pass, one request")
    parser.add_argument("--draft-row-ms", type=float, default=6.6, help="each further request")
    parser.add_argument(
        "--pass-table", type=parse_table, default=None, help="measured passes: 1:39.6,2:45.8,..."
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = load_model(args.model, progress=False, quantization="auto")
    server_args = ServerArgs(
        model_path=loaded.model_path,
        max_total_tokens=65536,
        speculative_algorithm=args.algorithm,
        speculative_draft_model_path=args.draft_model_path if args.algorithm == "draft" else None,
    )
    sched = settled_scheduler(server_args, loaded)
    tracer = StepTracer(sched)
    print("| workload | at once | priced speedup per round | drafted | accepted | draft passes |")
    print("|---|---:|---|---:|---:|---:|")
    for batch in sorted({1, args.concurrency}):
        for name in WORKLOADS:
            if batch > 1 and name in REASKED:
                continue
            prompt = loaded.tokenizer.encode(WORKLOADS[name])
            speedups, totals = [], [0, 0, 0]
            for r in range(args.rounds):
                sched.flush_cache()  # the prompt cached (with the answer, for a re-ask)
                run_batch(sched, prompt, 1, args.tokens if name in REASKED else 2, f"c{r}")
                tracer.steps.clear()
                run_batch(sched, prompt, batch, args.tokens, f"r{r}")
                speedups.append(priced_speedup(tracer.steps, batch, args))
                for i, count in enumerate(_counts(tracer.steps)):
                    totals[i] += count
            rounds = ", ".join(f"{s:.2f}x" for s in speedups)
            print(f"| {name} | {batch} | {rounds} | {totals[0]} | {totals[1]} | {totals[2]} |")
    return 0


def _counts(steps: list[TracedStep]) -> tuple[int, int, int]:
    return (
        sum(s.drafted for s in steps),
        sum(s.accepted for s in steps),
        sum(s.draft_passes for s in steps),
    )


if __name__ == "__main__":
    raise SystemExit(main())
