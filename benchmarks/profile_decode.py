"""Where a decode step's time goes: the scheduler driven in-process, its parts timed.

The model's parts (the native decode call for small batches, else matmuls, attention and fused
elementwise kernels) and the scheduler's (building the batch, sampling + detokenizing + stop
checks) are wrapped with wall-clock timers; what is left of a step is Python glue. Runs B
requests of a short prompt decoding N tokens each, greedy.

Run: python -m benchmarks.profile_decode [--model PATH] [--batch 1] [--tokens 64]
[--quantization auto] [--gguf-activations int8]

`--compare-native N` instead alternates, N rounds, the model's two decode paths (all layers in
one native call, or layer by layer from Python) on the same workload in this one process, and
prints each round's decode ms/step and their ratio (the host drifts too much between runs).
"""

from __future__ import annotations

import benchmarks.scheduler_env  # noqa: F401  (first: the scheduler's OpenMP setting)

# isort: split
import argparse
import functools
import gc
import os
import statistics
import time
from collections import defaultdict

import torch

from sglite.runtime.model import attention, causal_lm, kernels, linear, native_decode
from sglite.runtime.model.forward_batch import ForwardBatch
from sglite.runtime.model.layers import self_attention
from sglite.runtime.model.loader import load_model
from sglite.runtime.scheduler import scheduler as scheduler_module
from sglite.runtime.scheduler import token_sampler
from sglite.runtime.scheduler.io import GenerateInput
from sglite.runtime.scheduler.request_table import ReqStatus
from sglite.runtime.server_args import ServerArgs

TIMES: dict[str, float] = defaultdict(float)


def timed(label: str, fn):
    """`fn` accumulating its wall time under `label`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start

    return wrapper


def instrument() -> None:
    """Wrap the parts of a step with timers (module attributes, so every caller sees them)."""
    linear.Linear.forward = timed("matmul (projections)", linear.Linear.forward)
    causal_lm.CausalLM._lm_head = timed("matmul (output projection)", causal_lm.CausalLM._lm_head)
    self_attention.decode_attention = timed("attention", attention.decode_attention)
    for name in ("add_rms_norm", "gated_act", "rope_store_kv"):
        setattr(kernels, name, timed("fused elementwise kernels", getattr(kernels, name)))
    causal_lm.CausalLM.forward = timed("forward (total)", causal_lm.CausalLM.forward)
    native_decode.NativeDecoder.run = timed(
        "layers in one native call", native_decode.NativeDecoder.run
    )
    ForwardBatch.build = classmethod(timed("build batch", ForwardBatch.build.__func__))
    sampler = token_sampler.TokenSampler
    sampler.sample_and_append = timed("sample, detokenize, stop", sampler.sample_and_append)
    sched = scheduler_module.Scheduler
    sched.step = timed("step (total)", sched.step)


def settled_scheduler(server_args: ServerArgs, loaded) -> scheduler_module.Scheduler:
    """A scheduler in this process as a served one runs once settled: its background work
    done (the weights in 2 MB pages) and the heap frozen, as the scheduler process does."""
    sched = scheduler_module.Scheduler(server_args, loaded)
    while sched.has_background_work:
        sched.run_background_work()
    gc.collect()
    gc.freeze()
    return sched


def main() -> None:
    """Run the workload once to warm up, then timed, and print the breakdown."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a GGUF file or model directory (default model if not)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--gguf-activations", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--compare-native", type=int, default=0, metavar="ROUNDS")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(
        args.model,
        args.dtype,
        progress=False,
        quantization=args.quantization,
        gguf_activations=args.gguf_activations,
    )
    server_args = ServerArgs(
        max_total_tokens=65536,
        quantization=args.quantization,
        gguf_activations=args.gguf_activations,
        max_running_requests=max(64, args.batch),  # all B requests decode together
    )
    sched = settled_scheduler(server_args, loaded)
    params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}

    def run(tag: str) -> int:
        submit(sched, args, params, tag)
        steps = 0
        while sched.has_work:
            sched.step()
            steps += 1
        return steps

    run("warm")
    if args.compare_native:
        compare_native(loaded.model, sched, run_decode_only(sched, args, params), args)
        return
    instrument()
    TIMES.clear()
    steps = run("timed")
    step_total = TIMES["step (total)"]
    forward = TIMES["forward (total)"]
    model_parts = [
        "layers in one native call",
        "matmul (projections)",
        "matmul (output projection)",
        "attention",
        "fused elementwise kernels",
    ]
    print(
        f"{args.batch} x {args.tokens} tokens, {loaded.dtype}, quantization {args.quantization}, "
        f"{args.threads} threads: {steps} steps, {step_total / steps * 1e3:.2f} ms/step, "
        f"{args.batch * args.tokens / step_total:.1f} tok/s"
    )
    print("\n| part | ms/step | share |\n|---|---:|---:|")
    rows = [(name, TIMES[name]) for name in model_parts]
    rows.append(("model Python glue", forward - sum(TIMES[n] for n in model_parts)))
    rows.append(("build batch", TIMES["build batch"]))
    rows.append(("sample, detokenize, stop", TIMES["sample, detokenize, stop"]))
    other = step_total - forward - TIMES["build batch"] - TIMES["sample, detokenize, stop"]
    rows.append(("scheduler other", other))
    for name, seconds in rows:
        print(f"| {name} | {seconds / steps * 1e3:.2f} | {100 * seconds / step_total:.0f}% |")


def submit(sched, args: argparse.Namespace, params: dict, tag: str) -> None:
    """Queue the workload: `--batch` requests of distinct `--prompt-tokens`-token prompts."""
    for i in range(args.batch):
        ids = [(7 * i + j) % 30000 + 100 for j in range(args.prompt_tokens)]
        sched.add_request(GenerateInput(f"{tag}-{i}", ids, dict(params)))


def run_decode_only(sched, args: argparse.Namespace, params: dict):
    """A function running the workload once and returning seconds per decode step: the steps
    after the last prompt finished prefilling are timed."""

    def run(tag: str) -> float:
        submit(sched, args, params, tag)
        steps, start = 0, None
        while sched.has_work:
            sched.step()
            if start is None and sched.table.count(ReqStatus.RUNNING) == len(sched.table):
                start = time.perf_counter()  # every request is decoding from here on
            elif start is not None:
                steps += 1
        if start is None or steps == 0:
            raise SystemExit("no decode steps to time: raise --tokens")
        return (time.perf_counter() - start) / steps

    return run


def compare_native(model, sched, run, args: argparse.Namespace) -> None:
    """Alternate the native and the layer-by-layer decode path, round by round."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.compare_native):
        for native in (True, False):
            model.use_native_decode = native
            times[native].append(run(f"r{r}-{native}"))
    model.use_native_decode = True
    print(f"{args.batch} rows, {args.quantization}: decode ms/step, native vs layer by layer")
    print("| round | native | layer by layer | ratio |\n|---:|---:|---:|---:|")
    for r, (a, b) in enumerate(zip(times[True], times[False], strict=True)):
        print(f"| {r + 1} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x |")
    ratios = [b / a for a, b in zip(times[True], times[False], strict=True)]
    print(f"median ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
