"""Whole decode passes of R rows of one sequence (what verifying R - 1 drafted tokens costs the
model), its VNNI GEMM thresholds as built against other thresholds, alternated pass by pass.

`bench_products` times each weight's kernels alone, from cache; inside a pass the weights
stream from memory one after another, which can order the kernels otherwise. The model is
loaded as served (`dtype` and quantization `auto`) and its native decode step built twice:
once with the weights as built, once with the weights that take the VNNI GEMM from `FROM` rows
taking it from `TO` rows instead (`--against FROM:TO ...`, e.g. `5:8`: weights mostly of Q6_K
blocks from 8 rows, as before 601c2f0 on Intel hosts without AMX). One model in one process,
so both read the same pages: two loaded copies differ by up to ~10% where their pages land.
Per row count the two alternate, `--rounds` passes each; the table prints their median ms and
the ratio. These are the data behind the `A8_GEMM_MIN_ROWS` families in kernels.h, next to
bench_products'.

Run: python -m benchmarks.bench_pass_rows [--model qwen2.5-coder-1.5b] [--rows 3,4,5,6,8]
[--rounds 11] [--against 5:8]
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import command_line, make_parser, markdown_table
from benchmarks.host import cpu_line
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.catalog import resolve_model_path
from sglite.runtime.model.forward_batch import build_decode_rows
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.loader import LoadedModel, load_model

# The sequence the passes extend: this many tokens already in the KV pool.
CONTEXT_TOKENS = 200


def gguf_weights(loaded: LoadedModel) -> list[GGUFWeight]:
    """The model's GGUF weights (projections and head), each once."""
    found: dict[int, GGUFWeight] = {}
    for module in loaded.model.modules():
        for name in ("quantized", "lm_head_quantized", "_kernel"):
            weight = getattr(module, name, None)
            if isinstance(weight, GGUFWeight):
                found.setdefault(id(weight), weight)
    return list(found.values())


class ThresholdSwitch:
    """The model's weights under two sets of VNNI GEMM thresholds, each with its own native
    decode step (whose tables copy the thresholds when built); `use` switches between them."""

    def __init__(self, loaded: LoadedModel, moves: dict[int, int]) -> None:
        self.model = loaded.model
        self.moved = [
            (w, w.a8_gemm_min_rows, moves[w.a8_gemm_min_rows])
            for w in gguf_weights(loaded)
            if w.a8_gemm_min_rows in moves
        ]
        self.decoders = {}
        for name in ("built", "other"):
            self._set(name)
            self.model.weights_changed()
            self.decoders[name] = self.model._decoder()

    def _set(self, name: str) -> None:
        for weight, built, other in self.moved:
            weight.a8_gemm_min_rows = built if name == "built" else other

    def use(self, name: str) -> None:
        """The thresholds `name` ("built" or "other") for the passes that follow."""
        self._set(name)
        self.model._native_decoder = self.decoders[name]


class Passes:
    """Decode passes of a given number of rows over one cached sequence of a model."""

    def __init__(self, loaded: LoadedModel) -> None:
        cfg = loaded.config
        self.model = loaded.model
        self.pool = KVPool(
            CONTEXT_TOKENS + 64,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            loaded.dtype,
            loaded.device,
        )
        self.slots = list(range(CONTEXT_TOKENS + 64))
        self.table = torch.tensor(self.slots, dtype=torch.int64)

    def ms(self, rows: int) -> float:
        """One pass of `rows` DECODE rows (logits for every row, as a verification has)."""
        end = CONTEXT_TOKENS + rows
        feed = [(list(range(100, 100 + rows)), CONTEXT_TOKENS, self.slots[:end], self.table[:end])]
        batch = build_decode_rows(feed, list(range(rows)), "cpu")
        start = time.perf_counter()
        self.model(batch, self.pool)
        return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="GGUF path or known name")
    parser.add_argument("--rows", default="3,4,5,6,8")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--against", nargs="+", default=["5:8"], metavar="FROM:TO")
    args = parser.parse_args(argv)
    try:
        moves = dict(tuple(int(n) for n in move.split(":")) for move in args.against)
    except ValueError:
        parser.error(f"--against takes FROM:TO row counts, got {args.against}")
    rows_list = [int(r) for r in args.rows.split(",")]
    path = resolve_model_path(args.model)
    loaded = load_model(path, quantization="auto", progress=False)
    switch = ThresholdSwitch(loaded, moves)
    passes = Passes(loaded)
    print(command_line("benchmarks.bench_pass_rows"))
    print(f"host: {cpu_line()}; {len(switch.moved)} weights moved ({', '.join(args.against)})")
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for rows in rows_list:  # warm-up
            for name in ("built", "other"):
                switch.use(name)
                passes.ms(rows)
        for i in range(args.rounds):
            order = ("built", "other") if i % 2 == 0 else ("other", "built")
            for rows in rows_list:
                for name in order:
                    switch.use(name)
                    times.setdefault((name, rows), []).append(passes.ms(rows))
    table = []
    for rows in rows_list:
        a, b = (statistics.median(times[(name, rows)]) for name in ("built", "other"))
        table.append([str(rows), f"{a:.1f}", f"{b:.1f}", f"{b / a:.3f}x"])
    heads = ["rows", "as built (ms)", f"against {' '.join(args.against)} (ms)", "against / built"]
    print(markdown_table(heads, table, right={0, 1, 2, 3}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
