"""bench_segments' passes: one configuration's engine, its warm-up, TTFT and throughput passes
(waiting out queued segment fills between them), and what it measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import sglite
from benchmarks.segments_workload import Prompt, Workload

TOP_K = 20


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
