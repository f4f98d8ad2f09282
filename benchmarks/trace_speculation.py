"""What each decode step of a speculative engine did: the scheduler driven in-process, its steps
listed.

Runs `--batch` copies of a bench_spec workload's prompt (`--workload`, by name; optionally after
`--after`, other workloads run once each in the order named, whose drafts the speculator's state
then carries, as bench_spec's order leaves it), greedy,
`--tokens` new tokens, `--rounds` times from a flushed cache with the prompt cached. Per decode
step: the requests running, the speculative tokens drafted and their source, the tokens
accepted, the draft model's passes and the step's milliseconds; then per round the steps, the
seconds, and the steps that drafted. A step without drafts is a plain step (the cost a draft
must beat; steps that mixed sources or lost requests show no source).

Run: python -m benchmarks.trace_speculation [--model M] [--draft-model-path P | --ngram]
     [--workload NAME] [--after NAME ...] [--batch 4] [--tokens 96] [--rounds 2]
"""

from __future__ import annotations

import benchmarks.scheduler_env  # noqa: F401  (first: the scheduler's OpenMP setting)

# isort: split
import argparse
import time
from dataclasses import dataclass

from benchmarks.profile_decode import settled_scheduler  # noqa: E402
from benchmarks.spec_workloads import WORKLOADS  # noqa: E402
from sglite.runtime.model.loader import load_model  # noqa: E402
from sglite.runtime.scheduler.draft_model import DraftModelProposer  # noqa: E402
from sglite.runtime.scheduler.io import GenerateInput  # noqa: E402
from sglite.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from sglite.runtime.server_args import ServerArgs  # noqa: E402


@dataclass(frozen=True)
class TracedStep:
    """One decode step as the trace saw it."""

    running: int
    drafted: int
    source: str  # "" for a plain step or one whose drafts mixed sources
    accepted: int
    draft_passes: int
    ms: float


class StepTracer:
    """Wraps one scheduler's decode step (`DecodeManager.run`) and records its steps."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.steps: list[TracedStep] = []
        decode = sched.decode
        run = decode.run

        def traced() -> None:
            stats, model = self.sched.stats, self._draft_model()
            accepted, passes = stats.spec_accepted_tokens, self._passes(model)
            drafted_before = stats.spec_draft_tokens
            running = len(decode.running())
            start = time.perf_counter()
            run()
            ms = 1e3 * (time.perf_counter() - start)
            sources = set(decode.speculated.values())
            self.steps.append(
                TracedStep(
                    running,
                    stats.spec_draft_tokens - drafted_before,
                    sources.pop() if len(sources) == 1 else "",
                    stats.spec_accepted_tokens - accepted,
                    self._passes(model) - passes,
                    ms,
                )
            )

        decode.run = traced  # type: ignore[method-assign]

    def _draft_model(self) -> DraftModelProposer | None:
        """The speculator's draft model, alone or behind n-gram drafts (None: n-gram only)."""
        speculator = self.sched.decode.speculator
        found = (speculator, *getattr(speculator, "sources", ()))
        return next((s for s in found if isinstance(s, DraftModelProposer)), None)

    @staticmethod
    def _passes(model: DraftModelProposer | None) -> int:
        return 0 if model is None else model.kv.forward_passes


def run_batch(sched: Scheduler, prompt_ids: list[int], batch: int, tokens: int, tag: str) -> None:
    """`batch` copies of the prompt, greedy, to completion."""
    for i in range(batch):
        params = {"temperature": 0, "max_new_tokens": tokens}
        sched.add_request(GenerateInput(f"{tag}-{i}", list(prompt_ids), params))
    while sched.has_work:
        sched.step()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model-path", default="qwen2.5-coder-0.5b")
    parser.add_argument("--ngram", action="store_true", help="n-gram drafts, no draft model")
    parser.add_argument("--workload", default="copy: JSON record from a document")
    parser.add_argument("--after", nargs="*", default=[], help="workloads run once before")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    for name in (args.workload, *args.after):
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; one of: {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = load_model(args.model, progress=False, quantization="auto")
    speculation = {"speculative_algorithm": "ngram"}
    if not args.ngram:
        speculation = {
            "speculative_algorithm": "draft",
            "speculative_draft_model_path": args.draft_model_path,
        }
    server_args = ServerArgs(model_path=loaded.model_path, max_total_tokens=65536, **speculation)
    sched = settled_scheduler(server_args, loaded)
    tracer = StepTracer(sched)
    encode = loaded.tokenizer.encode
    for i, name in enumerate(args.after):
        run_batch(sched, encode(WORKLOADS[name]), args.batch, args.tokens, f"after{i}")
    prompt = encode(WORKLOADS[args.workload])
    print(f"{args.workload!r}, {args.batch} at once, {args.tokens} tokens, {speculation}")
    for r in range(args.rounds):
        sched.flush_cache()
        run_batch(sched, prompt, args.batch, 1, f"cached{r}")  # the prompt cached
        tracer.steps.clear()
        start = time.perf_counter()
        run_batch(sched, prompt, args.batch, args.tokens, f"round{r}")
        seconds = time.perf_counter() - start
        print_round(r, tracer.steps, seconds)
    return 0


def print_round(r: int, steps: list[TracedStep], seconds: float) -> None:
    """A round's steps as a table, and its totals."""
    drafting = [s for s in steps if s.drafted]
    print(
        f"\nround {r + 1}: {len(steps)} decode steps, {seconds:.2f} s, {len(drafting)} drafted "
        f"{sum(s.drafted for s in steps)} tokens, {sum(s.accepted for s in steps)} accepted"
    )
    print("| step | running | drafted | source | accepted | draft passes | ms |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for i, s in enumerate(steps):
        print(
            f"| {i + 1} | {s.running} | {s.drafted} | {s.source or '-'} | {s.accepted} | "
            f"{s.draft_passes} | {s.ms:.1f} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
