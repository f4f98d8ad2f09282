"""Engine benchmark: sglite against the machine's limits, llama.cpp and transformers, one run.

Measured on a GGUF (`--model`; the default model, SmolLM2-135M-Instruct's Q4_1, unless given),
same thread count for all:
- the machine: torch matmul GFLOP/s (float32, bfloat16) and memory read GB/s, from which the
  prefill roofline (the faster matmul's GFLOP/s / the model's GFLOP per prompt token: 2 x its
  layers' parameters, the embedding being a lookup and the output projection computed once per
  prompt) and the batch-1 decode limits follow;
- sglite (`dtype=auto`: bfloat16 where the CPU has it) with each weight format of
  `--quantizations` (for the default model dense, int8, int4 and w4a8, int4 with int8-rounded
  activations in the decode GEMVs, as llama.cpp computes; for others dense and auto): prefill
  of a 1000-token prompt, batch-1 decode (after a 16-token and after a 2000-token prompt; the
  first also as a share of the memory read rate measured just before and after it, which the
  bandwidth target checks: this host's rate drifts between minutes), 32
  concurrent decoding requests, and the shared-prefix workload (64 x (800 shared + 30 own
  tokens), 64 new tokens, greedy);
- accuracy of each weight format against float32 (max logit error, teacher-forced greedy
  agreement over a few prompts);
- llama.cpp (`llama-bench` pp1000 / tg128, and tg128 at depth 2000, on the same GGUF;
  `llama-server` with 16 slots and `cache_prompt` on the shared-prefix workload) when
  `benchmarks/build_llama_cpp.sh` built it;
- transformers (same GGUF, float32 and bfloat16): prefill and batch-1 decode.
Each figure is printed beside its target (`targets`: shares of the machine's limits, ratios to
llama.cpp and transformers). llama.cpp is the build `runners.llama_cpp.find_llama_server` picks
(`--llama-server PATH`, else the build script's best configuration for the host, else PATH),
named in its rows and in the report's `llama.cpp:` line (the script's `BUILD` record). A run
that crashes is a row of its own, "crashed at start-up (exit -11 SIGSEGV, log: PATH)", and a
line under "Not measured or crashed"; when llama-bench crashes, it is measured again with
`--repack 0` and those rows say "fallback: --repack 0, the default crashed", never silently.
Ratios are what to quote; absolute times on a shared machine are noisy.

Run: python -m benchmarks.bench_engine [--model PATH.gguf] [--quick] [--skip-llama-cpp]
[--skip-transformers] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import sglite
from benchmarks.common import PeerStatus, add_json_option, add_llama_server_option
from sglite.runtime.model import kernels
from sglite.runtime.model.catalog import resolve_model_path


def gflop_per_token(model_path: str) -> float:
    """2 x the parameters of the model's layers (attention and MLP projections, norms)."""
    from sglite.runtime.model.gguf_index import open_gguf

    params = sum(
        int(torch.tensor(t.shape).prod())
        for t in open_gguf(model_path).tensors
        if t.name.startswith("blk.")
    )
    return 2 * params / 1e9


def weight_bytes_per_token(model_path: str) -> int:
    """Bytes of weights one batch-1 decode step reads: every layer's tensors and the output
    projection (the tied embedding where the file has no `output.weight`), as the file stores
    them; the embedding lookup reads one row."""
    from sglite.runtime.model.gguf_index import open_gguf

    tensors = {t.name: t.n_bytes for t in open_gguf(model_path).tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight", 0))
    return sum(n for name, n in tensors.items() if name.startswith("blk.")) + head


@dataclass
class Row:
    """One line of the results table."""

    metric: str
    system: str
    value: float
    unit: str
    status: str = ""  # instead of a value: why there is none (a peer's `PeerStatus.cell()`)

    def value_cell(self) -> str:
        """The value, or the status standing in for it."""
        return self.status or f"{self.value:,.2f}"


def status_row(metric: str, system: str, status: PeerStatus) -> Row:
    """A row saying why `system` has no figure for `metric` (it crashed, ...)."""
    return Row(metric, system, float("nan"), "", status.cell())


class EchoList(list):
    """A list of rows that prints each row as it arrives (a later failure keeps the earlier)."""

    def append(self, row: Row) -> None:
        """Add and print."""
        print(f"  {row.metric} | {row.system} | {row.value_cell()} {row.unit}", flush=True)
        super().append(row)


def make_words(n_tokens: int, seed: int) -> str:
    """Synthetic text of roughly n_tokens tokens (no dataset download needed)."""
    rng = random.Random(seed)
    vocab = (
        "the of and a to in is you that it he was for on are as with his they at be this have "
        "from or one had by word but not what all were we when your can said there use an each "
        "which she do how their if will up other about out many then them these so some her would "
        "make like him into time has look two more write go see number no way could people my "
        "than first water been call who oil its now find long down day did get come made may part"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(n_tokens))


def exact_prompt_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """Token ids of synthetic text cut to exactly n_tokens."""
    ids = tokenizer.encode(make_words(n_tokens * 2, seed))
    return ids[:n_tokens]


def shared_prefix_workload(tokenizer, n_requests: int) -> list[list[int]]:
    """n_requests x (800 shared + 30 distinct tokens)."""
    prefix = exact_prompt_ids(tokenizer, 800, seed=1)
    return [prefix + exact_prompt_ids(tokenizer, 30, seed=100 + i) for i in range(n_requests)]


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ------------------------------------------------------------------------------ the machine
def bandwidth_probe() -> torch.Tensor:
    """A tensor beyond any cache (512 MB) for `read_gbs`."""
    return torch.ones(1 << 27, dtype=torch.float32)


def read_gbs(probe: torch.Tensor, repeats: int = 2) -> float:
    """GB/s of summing `probe`: the memory read rate at this moment."""
    return probe.numel() * probe.element_size() / _best(lambda: probe.sum(), repeats) / 1e9


def bench_machine(rows: list[Row], gflop: float, weight_bytes: int) -> dict[str, float]:
    """Matmul GFLOP/s and memory bandwidth with torch, on this run's threads, and the limits
    they set: prefill (matmul / FLOP per token), batch-1 decode (bandwidth / weight bytes per
    token) and 32 concurrent decodes (the lower of 32 x the decode limit and the prefill one)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        # 1024^3 first: where bf16 is emulated, a 2048^3 product is too slow to repeat.
        size = 1024
        a = torch.randn(size, size, dtype=dtype)
        start = time.perf_counter()
        a @ a
        if time.perf_counter() - start < 0.05:
            size = 2048
            a = torch.randn(size, size, dtype=dtype)
            a @ a
        t = _best(lambda a=a: a @ a, 5 if size == 2048 else 2)
        name = str(dtype).replace("torch.", "")
        out[name] = 2 * size**3 / t / 1e9
        rows.append(Row(f"matmul {size}^3 {name}", "torch", out[name], "GFLOP/s"))
    out["read_gbs"] = read_gbs(bandwidth_probe(), 5)
    rows.append(Row("memory read", "torch", out["read_gbs"], "GB/s"))
    # The prefill target is set against the bf16 matmul; on CPUs without native bf16 (where
    # PyTorch emulates it at a fraction of float32's rate and sglite runs float32) the faster
    # of the two is the machine's limit.
    best = max(out["bfloat16"], out["float32"])
    out["prefill_roofline"] = best / gflop
    rows.append(Row("prefill roofline (best matmul)", "torch", out["prefill_roofline"], "tok/s"))
    out["decode_limit"] = out["read_gbs"] * 1e9 / weight_bytes
    rows.append(Row("batch-1 decode limit (bandwidth)", "torch", out["decode_limit"], "tok/s"))
    out["batch32_roofline"] = min(32 * out["decode_limit"], out["prefill_roofline"])
    rows.append(Row("32 concurrent decode roofline", "torch", out["batch32_roofline"], "tok/s"))
    # Whether sglite's bf16 products take AVX512-BF16 dot products here (kernels/bf16_probe.c).
    taken = "bf16 products" if kernels.bf16_matmul_pays() else "float32 products"
    rate = kernels.bf16_dot_speed_percent()
    rows.append(Row(f"vdpbf16ps rate (% of an FMA's; sglite: {taken})", "probe", rate, "%"))
    return out


# ------------------------------------------------------------------------------ sglite
# Batch-1 decode is also measured after a prompt of this many tokens (agents and chats decode
# at depth: there attention over the cache, not the weights, sets much of the step's cost).
LONG_CONTEXT = 2000
LONG_DECODE = f"batch-1 decode at {LONG_CONTEXT}-token context"


GREEDY = {"temperature": 0, "ignore_eos": True}
# Prefill passes timed (the best counts) even in a quick run: each is short.
PREFILL_REPEATS = 3


def _decode_rate(engine, prompts: list[list[int]], n_dec: int) -> float:
    """Output tokens/s of the decode phase: (full run - first-token run), cache flushed each."""
    engine.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1})
    first = time.perf_counter() - start
    engine.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n_dec + 1})
    total = time.perf_counter() - start
    return len(prompts) * n_dec / (total - first)


BANDWIDTH_SHARE = "batch-1 decode share of the read rate measured around it"


def batch1_decode(engine, prompt: list[list[int]], args: argparse.Namespace) -> tuple[float, float]:
    """(best batch-1 decode tokens/s, its share of the memory bandwidth in %): each repeat's
    weight bytes read per second against the read rate measured just before and after it, as
    this host's rate drifts by 20-30% between minutes."""
    probe, per_token = bandwidth_probe(), weight_bytes_per_token(args.model)
    runs = []
    for _ in range(args.repeats):
        before = read_gbs(probe)
        rate = _decode_rate(engine, prompt, args.decode_tokens)
        around = (before + read_gbs(probe)) / 2
        runs.append((rate, 100 * rate * per_token / (around * 1e9)))
    return max(runs)


def decode_rate_at_depth(engine, prompt: list[int], n_dec: int) -> float:
    """Batch-1 tokens/s of decoding after `prompt`, kept in the radix cache: (n_dec + 1)-token
    run minus 1-token run, both served from the cache, so a long prefill's noise drops out."""

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": tokens})
        return time.perf_counter() - start

    timed(1)  # prefill once: the prompt is then in the cache
    first = timed(1)
    return n_dec / (timed(n_dec + 1) - first)


def split_format(spec: str) -> tuple[str, str]:
    """A weight format of `--quantizations` as (quantization, gguf_activations): "auto" is the
    GGUF's blocks with the host's activation path, "auto/float" and "auto/int8" force one."""
    quantization, _, activations = spec.partition("/")
    return quantization, activations or "auto"


def format_name(kind: str, activations: str) -> str:
    """A format's label: the block types (or dense), with a8 where activations are rounded."""
    label = kind if kind != "none" else "dense"
    return f"{label} a8" if activations == "int8" else label


def bench_sglite(args: argparse.Namespace, rows: list[Row], spec: str) -> None:
    """One engine per weight format: prefill, batch-1 and 32-way decode, shared prefix."""
    quantization, activations = split_format(spec)
    engine = sglite.Engine(
        model_path=args.model,
        dtype=args.dtype,
        log_level="error",
        quantization=quantization,
        gguf_activations=activations,
    )
    with engine:
        tok = engine.tokenizer
        info = engine.get_server_info()
        kind = info["quantization"] if quantization == "auto" else quantization
        name = f"sglite {info['dtype']} {format_name(kind, info['activations'])}"
        isa = ", ".join(info["kernel_isa"]) or "portable C"
        path = f"native kernels ({isa})" if info["native_kernels"] else "PyTorch (no native)"
        print(f"  {name}: {path}; weights: {'; '.join(info['weight_layouts'])}", flush=True)
        prompt = exact_prompt_ids(tok, 1000, seed=0)

        def prefill() -> None:
            engine.flush_cache()
            engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})

        # Warm-up at the measured size: the first 1000-token pass also pays for first touches
        # of the KV pool's pages and for oneDNN building its kernels for that row count, which
        # a single timed pass (the quick run's) would count as prefill time.
        prefill()
        engine.generate(input_ids=prompt[:100], sampling_params={"max_new_tokens": 2})
        best = _best(prefill, max(args.repeats, PREFILL_REPEATS))
        rows.append(Row("prefill 1000 tokens", name, 1000 / best, "tok/s"))
        short = [exact_prompt_ids(tok, 16, seed=3)]
        rate, share = batch1_decode(engine, short, args)
        rows.append(Row("batch-1 decode", name, rate, "tok/s"))
        rows.append(Row(BANDWIDTH_SHARE, name, share, "%"))
        deep = exact_prompt_ids(tok, LONG_CONTEXT, seed=5)
        rate = max(decode_rate_at_depth(engine, deep, args.decode_tokens) for _ in range(2))
        rows.append(Row(LONG_DECODE, name, rate, "tok/s"))
        many = [exact_prompt_ids(tok, 64, seed=200 + i) for i in range(32)]
        rate = _decode_rate(engine, many, args.decode_tokens)
        rows.append(Row("32 concurrent decode", name, rate, "out tok/s"))
        if quantization != "none" and args.quick:
            return
        engine.flush_cache()
        before = engine.get_server_info()
        work = shared_prefix_workload(tok, args.requests)
        greedy = {**GREEDY, "max_new_tokens": args.new_tokens}
        start = time.perf_counter()
        outs = engine.generate(input_ids=work, sampling_params=greedy)
        elapsed = time.perf_counter() - start
        after = engine.get_server_info()
        out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        hit = (after["cached_prompt_tokens"] - before["cached_prompt_tokens"]) / max(
            1, after["queried_prompt_tokens"] - before["queried_prompt_tokens"]
        )
        rows.append(Row("shared-prefix workload", name, out_tokens / elapsed, "out tok/s"))
        rows.append(Row("shared-prefix cache hit rate", name, 100 * hit, "%"))


# ------------------------------------------------------------------------------ accuracy
ACCURACY_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Write a haiku about the sea:\n",
]


def teacher_forced(loaded, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Prefill, then decode one token at a time (the batch-1 path): the logits before each of
    `steps` tokens, and the tokens (`forced`, else the model's own greedy choices)."""
    from sglite.runtime.cache.kv_pool import KVPool
    from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode

    cfg = loaded.config
    pool = KVPool(512, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    slots = pool.alloc(len(prompt))
    n = len(prompt)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [0], [slots], [n - 1])
    out, tokens = [loaded.model(batch, pool)[0]], []
    for i in range(steps):
        tokens.append(forced[i] if forced is not None else int(out[-1].argmax()))
        if i + 1 == steps:
            break
        slots = slots + pool.alloc(1)
        step = [[tokens[-1]]]
        batch = ForwardBatch.build(ForwardMode.DECODE, step, [len(slots) - 1], [slots], [0])
        out.append(loaded.model(batch, pool)[0])
    return torch.stack(out), tokens


def bench_accuracy(args: argparse.Namespace, rows: list[Row]) -> None:
    """Each weight format against float32 dense on the same token sequences (teacher forcing)."""
    from sglite.runtime.model.loader import load_model

    ref_model = load_model(args.model, "float32", progress=False)
    tok = ref_model.tokenizer
    cases = []
    for text in ACCURACY_PROMPTS:
        prompt = tok.encode(text)
        ref_logits, forced = teacher_forced(ref_model, prompt, args.accuracy_tokens)
        cases.append((prompt, forced, ref_logits))
    formats = [("bfloat16", "none")]
    formats += [("bfloat16", q) for q in args.quantizations if q not in ("none", "w4a8")]
    formats += [("float32", q) for q in args.quantizations if q != "none"]
    for dtype, spec in formats:
        quantization, activations = split_format(spec)
        loaded = load_model(
            args.model,
            dtype,
            progress=False,
            quantization=quantization,
            gguf_activations=activations,
        )
        worst, agree, total = 0.0, 0, 0
        for prompt, forced, ref in cases:
            ours, _ = teacher_forced(loaded, prompt, len(forced), forced)
            worst = max(worst, float((ours - ref).abs().max()))
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            total += len(forced)
        kind = loaded.quantization if quantization == "auto" else quantization
        name = f"{dtype} {format_name(kind, loaded.activations)}"
        rows.append(Row("max |logit error| vs float32", name, worst, ""))
        rows.append(Row("greedy agreement vs float32", name, 100 * agree / total, "%"))


# ------------------------------------------------------------------------------ llama.cpp
LLAMA_BENCH_METRICS = ("prefill 1000 tokens", "batch-1 decode", LONG_DECODE)
REPACK_FALLBACK = "fallback: --repack 0, the default crashed"


def bench_llama_cpp(args: argparse.Namespace, rows: list[Row]) -> list[str]:
    """llama-bench prefill/decode and llama-server on the shared-prefix workload, with the build
    `find_llama_server` picks (named in the rows); a run that crashes gets a status row and a
    note (returned), a fallback configuration is named as one."""
    from benchmarks.runners.llama_cpp import llama_binaries, llama_build, llama_build_line

    bench, server = llama_binaries(args.llama_server)
    if bench is None:
        return ["llama.cpp not found (bash benchmarks/build_llama_cpp.sh): not measured"]
    threads = str(args.threads)
    build = llama_build(bench)
    args.llama_build = llama_build_line(bench)
    name = f"llama.cpp {build}"
    notes: list[str] = []
    extra: tuple[str, ...] = ()
    results, failure = _llama_bench(bench, args.model, threads, ())
    if results is None:
        # Its AMX path crashes on some CPUs; the script's build avoids it, another may not.
        for metric in LLAMA_BENCH_METRICS:
            rows.append(status_row(metric, name, failure))
        notes.append(f"llama.cpp {failure.line()}; measured again with --repack 0")
        extra = ("--repack", "0")
        results, failure = _llama_bench(bench, args.model, threads, extra)
        name = f"{name} ({REPACK_FALLBACK})"
    if results is None:
        for metric in LLAMA_BENCH_METRICS:
            rows.append(status_row(metric, name, failure))
        return [*notes, f"llama.cpp with --repack 0 {failure.line()}"]
    for result in results:
        if result.get("n_prompt"):
            rows.append(Row("prefill 1000 tokens", name, result["avg_ts"], "tok/s"))
        elif result.get("n_gen"):
            metric = LONG_DECODE if result.get("n_depth") else "batch-1 decode"
            rows.append(Row(metric, name, result["avg_ts"], "tok/s"))
    if failure is not None:  # the run at depth crashed after the first succeeded
        rows.append(status_row(LONG_DECODE, name, failure))
        notes.append(f"llama.cpp at depth {LONG_CONTEXT} {failure.line()}")
    if server is None or args.quick:
        return notes
    return notes + _llama_server_shared_prefix(args, rows, server, build, extra)


def _llama_server_shared_prefix(
    args: argparse.Namespace, rows: list[Row], server: str, build: str, extra: tuple[str, ...]
) -> list[str]:
    """llama-server (16 slots, `cache_prompt`) on the shared-prefix workload: its rows, or
    status rows and a note when it crashes or its calls fail."""
    from benchmarks.common import PeerCrashed, post_json, stop_process
    from benchmarks.runners.llama_cpp import llama_failure, start_llama_server
    from sglite.runtime.model.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    work = shared_prefix_workload(tok, args.requests)
    server_extra = ("--no-repack",) if extra else ()
    name = f"llama.cpp server {build} (16 slots)" + (f" ({REPACK_FALLBACK})" if extra else "")
    metrics = ("shared-prefix workload", "shared-prefix cache hit rate")
    proc = None
    with tempfile.NamedTemporaryFile(
        "w", suffix=".log", prefix="llama-server-", delete=False
    ) as log:
        try:
            proc, base = start_llama_server(
                server, args.model, args.threads, 16, 2048, log, server_extra
            )
            body = {"temperature": 0, "n_predict": args.new_tokens, "ignore_eos": True}
            body["cache_prompt"] = True

            def one(ids: list[int]) -> dict:
                return post_json(base + "/completion", {**body, "prompt": ids})

            start = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(one, work))
            elapsed = time.perf_counter() - start
        except (PeerCrashed, OSError, ValueError) as exc:
            status = llama_failure(server, proc, log.name, exc)
            for metric in metrics:
                rows.append(status_row(metric, name, status))
            return [f"llama.cpp server {status.line()}"]
        finally:
            if proc is not None:
                stop_process(proc, timeout=30)
    os.unlink(log.name)
    out_tokens = sum(a["timings"]["predicted_n"] for a in answers)
    cached = sum(a["timings"].get("cache_n", 0) for a in answers)
    prompt = sum(a["timings"].get("cache_n", 0) + a["timings"]["prompt_n"] for a in answers)
    rows.append(Row(metrics[0], name, out_tokens / elapsed, "out tok/s"))
    rows.append(Row(metrics[1], name, 100 * cached / prompt, "%"))
    return []


def _llama_bench(
    bench: str, model: str, threads: str, extra: tuple[str, ...]
) -> tuple[list[dict] | None, PeerStatus | None]:
    """llama-bench pp1000 / tg128, then tg128 after LONG_CONTEXT tokens (`-d`), on the GGUF:
    (results, None); (None, the crash) when the first run fails; (the first's results, the
    crash) when only the second does. A failed run's output is kept in a log the status names."""
    from benchmarks.runners.llama_cpp import llama_status

    runs = [
        ["-p", "1000", "-n", "128"],
        ["-p", "0", "-n", "128", "-d", str(LONG_CONTEXT)],
    ]
    results: list[dict] = []
    for i, run in enumerate(runs):
        cmd = [bench, "-m", model, *run, "-t", threads, *extra]
        done = subprocess.run([*cmd, "-o", "json"], capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            with tempfile.NamedTemporaryFile(
                "w", prefix="llama-bench-", suffix=".log", delete=False
            ) as log:
                log.write(f"$ {' '.join(cmd)} -o json\n{done.stdout}\n{done.stderr}")
            status = llama_status(bench, "crashed", exit_code=done.returncode, log=log.name)
            status.name = f"llama-bench {' '.join(run)}"
            print(status.line(), flush=True)
            return (None if i == 0 else results), status
        results += json.loads(done.stdout)
    return results, None


# ------------------------------------------------------------------------------ transformers
def bench_transformers(args: argparse.Namespace, rows: list[Row], dtype: torch.dtype) -> None:
    """transformers on the same GGUF weights, same thread count: prefill and batch-1 decode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(args.model)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype).eval()
    name = f"transformers {str(dtype).replace('torch.', '')}"
    prompt = exact_prompt_ids(tok, 1000, seed=0)
    with torch.inference_mode():
        model(torch.tensor([prompt[:100]]))
        t = _best(lambda: model(torch.tensor([prompt])), args.repeats)
        rows.append(Row("prefill 1000 tokens", name, 1000 / t, "tok/s"))
        short = torch.tensor([exact_prompt_ids(tok, 16, seed=3)])
        n_dec = args.decode_tokens
        kw = {"do_sample": False, "pad_token_id": tok.eos_token_id}
        first = _best(lambda: model.generate(short, max_new_tokens=1, min_new_tokens=1, **kw), 1)
        total = _best(
            lambda: model.generate(short, max_new_tokens=n_dec + 1, min_new_tokens=n_dec + 1, **kw),
            1,
        )
        rows.append(Row("batch-1 decode", name, n_dec / (total - first), "tok/s"))


# ------------------------------------------------------------------------------ report
def _value(rows: list[Row], metric: str, system_prefix: str) -> float | None:
    values = [
        r.value
        for r in rows
        if r.metric == metric and r.system.startswith(system_prefix) and not r.status
    ]
    return max(values) if values else None


def _why_missing(rows: list[Row], metric: str, system_prefix: str) -> str:
    """Why a system has no figure for a metric, from its status rows ("" if none says)."""
    cells = [
        f"{r.system} {r.status}"
        for r in rows
        if r.metric == metric and r.system.startswith(system_prefix) and r.status
    ]
    return "; ".join(cells)


def targets(rows: list[Row], machine: dict[str, float]) -> list[str]:
    """Each speed target with the figures it compares and whether it is met (sglite's best
    format against llama.cpp's best build and transformers' best dtype)."""
    lines = []

    def check(label: str, ours: float | None, bar: float | None, how: str, why: str = "") -> None:
        if ours is None or bar is None:
            because = f": {why}" if why and bar is None else ""
            lines.append(f"- {label}: not measured in this run ({how}){because}")
            return
        status = "MET" if ours >= bar else "MISSED"
        lines.append(f"- {label}: {status} ({ours:,.1f} vs target {bar:,.1f}; {how})")

    decode = _value(rows, "batch-1 decode", "sglite")
    check(
        "batch-1 decode >= 85% of the bandwidth limit",
        _value(rows, BANDWIDTH_SHARE, "sglite"),
        85.0,
        "% of the read rate measured before and after the decode run; the limit from the "
        f"start's read rate: {machine['decode_limit']:,.1f} tok/s",
    )
    llama = _value(rows, "batch-1 decode", "llama.cpp")
    check(
        "batch-1 decode >= 1.1x llama.cpp",
        decode,
        llama and 1.1 * llama,
        "tg128",
        _why_missing(rows, "batch-1 decode", "llama.cpp"),
    )
    llama_long = _value(rows, LONG_DECODE, "llama.cpp")
    check(
        f"batch-1 decode at {LONG_CONTEXT}-token context >= 1.25x llama.cpp",
        _value(rows, LONG_DECODE, "sglite"),
        llama_long and 1.25 * llama_long,
        f"tg128 at depth {LONG_CONTEXT}",
        _why_missing(rows, LONG_DECODE, "llama.cpp"),
    )
    prefill = _value(rows, "prefill 1000 tokens", "sglite")
    check(
        "prefill >= 70% of the matmul roofline (bf16, or float32 where faster)",
        prefill,
        0.7 * machine["prefill_roofline"],
        f"roofline {machine['prefill_roofline']:,.0f} tok/s",
    )
    hf = _value(rows, "prefill 1000 tokens", "transformers")
    check("prefill >= 2x transformers (its best dtype)", prefill, hf and 2 * hf, "")
    check(
        "32 concurrent decode >= 50% of the roofline",
        _value(rows, "32 concurrent decode", "sglite"),
        0.5 * machine["batch32_roofline"],
        f"roofline {machine['batch32_roofline']:,.0f} tok/s",
    )
    return lines


def report(
    rows: list[Row], machine: dict[str, float], args: argparse.Namespace, notes: list[str]
) -> str:
    """Markdown: the table of every figure, the targets, then what could not be measured."""
    lines = [
        f"model: {os.path.basename(args.model)}",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} threads, torch {torch.__version__}",
    ]
    if getattr(args, "llama_build", None):
        lines.append(f"llama.cpp: {args.llama_build}")
    lines += ["", "| metric | system | value | unit |", "|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r.metric} | {r.system} | {r.value_cell()} | {r.unit} |")
    lines += ["", "Targets:", "", *targets(rows, machine)]
    if notes:
        lines += ["", "Not measured or crashed:", "", *(f"- {note}" for note in notes)]
    text = "\n".join(lines)
    print(text)
    return text


def main() -> None:
    """Parse flags, run every system, print the table and the targets."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", help="a GGUF file or known model name (default: the default model)"
    )
    parser.add_argument(
        "--quantizations",
        help="comma-separated weight formats to run: none (dense), int8, int4, w4a8, auto (a "
        "GGUF's own blocks, the host's activation path), auto/float or auto/int8 (blocks with "
        "that path); default model: none,int8,int4,w4a8,auto/float,auto/int8; others: "
        "none,auto/float,auto/int8",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and workloads")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--accuracy-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    add_llama_server_option(parser)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    add_json_option(parser)
    args = parser.parse_args()
    default = args.model is None
    args.model = resolve_model_path(args.model)
    blocks = "auto/float,auto/int8"
    formats = args.quantizations or (
        f"none,int8,int4,w4a8,{blocks}" if default else f"none,{blocks}"
    )
    args.quantizations = formats.split(",")
    if args.quick:
        args.requests, args.new_tokens, args.repeats, args.accuracy_tokens = 16, 16, 1, 8
    torch.set_num_threads(args.threads)
    rows: list[Row] = EchoList()
    machine = bench_machine(rows, gflop_per_token(args.model), weight_bytes_per_token(args.model))
    for quantization in args.quantizations:
        bench_sglite(args, rows, quantization)
    if not args.skip_accuracy:
        bench_accuracy(args, rows)
    notes: list[str] = []
    if not args.skip_llama_cpp:
        notes += bench_llama_cpp(args, rows)
    if not args.skip_transformers:
        if importlib.util.find_spec("accelerate") is None:
            notes.append(
                "transformers not run: it loads a GGUF only with accelerate, which is "
                "not installed (pip install -e '.[bench]')"
            )
        else:
            bench_transformers(args, rows, torch.float32)
            bench_transformers(args, rows, torch.bfloat16)
    report(rows, machine, args, notes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
