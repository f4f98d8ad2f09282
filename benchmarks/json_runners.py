"""The JSON benchmark's runners: one sglite engine configuration, or llama.cpp's llama-server
with grammar-constrained sampling, started fresh, timed on every variant's batch and shut down."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import PeerCrashed, cpu_seconds, post_json, stop_process
from benchmarks.json_documents import CHAT, Doc, constraint_params
from benchmarks.json_results import Run, best_of
from benchmarks.runners.llama_cpp import llama_failure, start_llama_server

SGLITE_CONFIGS = {
    "none": {"disable_jump_forward": True},
    "exact": {"jump_forward_mode": "exact"},
    "retokenize": {"jump_forward_mode": "retokenize"},
    "free": {},
}
COUNTERS = ("forward_passes", "decode_passes", "jump_forward_drafted_tokens",
            "jump_forward_accepted_tokens")  # fmt: skip


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def bench_sglite(config: str, args: argparse.Namespace, docs: list[Doc]) -> list[Run]:
    """Start an engine for one configuration, run each variant on a cold cache, shut it down."""
    import sglite

    variants = ["free"] if config == "free" else args.variants
    kwargs = dict(SGLITE_CONFIGS[config], dtype=args.dtype, grammar_backend=args.grammar_backend)
    if args.threads:
        kwargs["num_threads"] = args.threads
    runs = []
    with sglite.Engine(log_level="error", **kwargs) as engine:
        args.resolved_dtype = engine.get_server_info().get("dtype")
        warm = CHAT.format("Say hi.")
        engine.generate(warm, {"max_new_tokens": 4, "temperature": 0})
        engine.generate(warm, {"max_new_tokens": 4, "temperature": 0, "regex": "[a-z]{1,8}"})
        for variant in variants:
            params = [
                {
                    "max_new_tokens": args.max_new_tokens,
                    "temperature": 0,
                    **constraint_params(doc, variant),
                }
                for doc in docs
            ]
            tries = []
            for _ in range(args.repeats):
                engine.flush_cache()
                before = engine.get_server_info()
                cpu0 = cpu_seconds(engine.client.process.pid)
                start = time.perf_counter()
                outs = engine.generate([d.prompt for d in docs], params)
                wall = time.perf_counter() - start
                cpu = _delta(cpu_seconds(engine.client.process.pid), cpu0)
                after = engine.get_server_info()
                delta = {k: after[k] - before[k] for k in COUNTERS}
                tries.append(
                    Run(
                        config=config,
                        variant=variant,
                        wall_s=wall,
                        docs=len(docs),
                        out_tokens=sum(o["meta_info"]["completion_tokens"] for o in outs),
                        texts=[o["text"] for o in outs],
                        cpu_s=cpu,
                        ids=[list(o["output_ids"]) for o in outs],
                        forward_passes=delta["forward_passes"],
                        decode_passes=delta["decode_passes"],
                        drafted=delta["jump_forward_drafted_tokens"],
                        accepted=delta["jump_forward_accepted_tokens"],
                    )
                )
            runs.append(best_of(tries))
            print(f"  [{config}/{variant}] {runs[-1].wall_s:.1f} s", flush=True)
    return runs


def llama_body(doc: Doc, variant: str, args: argparse.Namespace) -> dict:
    """A greedy /completion request, constrained like sglite's."""
    body = {
        "prompt": doc.prompt,
        "n_predict": args.max_new_tokens,
        "temperature": 0,
        "cache_prompt": True,
        "stream": False,
    }
    if variant == "schema":
        body["json_schema"] = doc.kind.schema()
    else:
        body["grammar"] = doc.kind.gbnf()
    return body


def _llama_once(
    binary: str, args: argparse.Namespace, docs: list[Doc], variant: str, slots: int, log
) -> Run:
    """One timed batch on a freshly started llama-server."""
    from sglite.runtime.model.loader import default_model_path

    threads = args.threads or os.cpu_count() or 1
    ctx = args.llama_ctx_per_slot
    proc, base = start_llama_server(binary, default_model_path(), threads, slots, ctx, log)
    try:
        post_json(base + "/completion", {"prompt": CHAT.format("Say hi."), "n_predict": 4})
        bodies = [llama_body(doc, variant, args) for doc in docs]
        cpu0 = cpu_seconds(proc.pid)
        start = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            url = base + "/completion"
            outs = list(pool.map(post_json, [url] * len(bodies), bodies))
        wall = time.perf_counter() - start
        cpu = _delta(cpu_seconds(proc.pid), cpu0)
    except (OSError, ValueError) as exc:
        status = llama_failure(binary, proc, log.name, exc)
        if status.state == "crashed":
            raise PeerCrashed(status) from exc
        raise
    finally:
        stop_process(proc, timeout=30)
    tokens = [
        o.get("tokens_predicted", (o.get("timings") or {}).get("predicted_n", 0)) for o in outs
    ]
    texts = [o["content"] for o in outs]
    return Run("llama", variant, wall, len(docs), sum(tokens), texts, cpu_s=cpu)


def bench_llama(binary: str, args: argparse.Namespace, docs: list[Doc]) -> list[Run]:
    """Each variant on a freshly started llama-server (an empty prompt cache, as sglite's); a
    variant whose server crashes is a `Run` with that status (its log kept and named)."""
    slots = args.llama_parallel or min(len(docs), 64)
    runs = []
    crashed = False
    with tempfile.NamedTemporaryFile(
        "w", prefix="llama-server-", suffix=".log", delete=False
    ) as log:
        for variant in args.variants:
            try:
                tries = [
                    _llama_once(binary, args, docs, variant, slots, log)
                    for _ in range(args.repeats)
                ]
            except PeerCrashed as exc:
                crashed = True
                runs.append(Run("llama", variant, float("nan"), len(docs), 0, []))
                runs[-1].status = exc.status.cell()
                print(f"  [llama/{variant}] {exc}", flush=True)
                continue
            runs.append(best_of(tries))
            print(f"  [llama/{variant}] {runs[-1].wall_s:.1f} s", flush=True)
    if not crashed:
        os.unlink(log.name)
    return runs
