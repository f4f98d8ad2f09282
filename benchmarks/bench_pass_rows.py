"""Whole decode passes of R rows of one sequence (what verifying R - 1 drafted tokens costs the
model), its VNNI GEMM thresholds as built against other thresholds, or its weights' layout
against the other (`--against file-rows`), alternated pass by pass.

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

`--against extend`: the same rows as DECODE rows (as built) and as one EXTEND pass, the choice
a draft model makes per pass by its row count (`draft_model_kv.DECODE_ROWS_MAX`); with
`--as-draft` the model is loaded as a draft model is (`draft_model_loading`: tiled, no GEMM
packing) and its passes return hidden states, not logits (a draft chooses among its draft
vocabulary's rows apart).

`--against file-rows`: the weights as the model holds them (the file's rows, unless tiled or in
quads) against the other layout (tiled for the VNNI GEMM where it can serve them:
kernels/gguf_tiles.h, the GEMM then their one kernel; or the file's rows where the model holds
them tiled or in quads, kernels/gguf_quads.h), both copied into weight arenas of their own and
moved into 2 MB pages, so that both read the same kind of memory; `--tile-types` names the
block types the tiled layout tiles (all it can, by default). The data behind which models are
tiled (`loader._tiled_types`) and which hold Q5_0 in quads (`kernels.gguf_quads_pay`).

Run: python -m benchmarks.bench_pass_rows [--model qwen2.5-coder-1.5b] [--rows 3,4,5,6,8]
[--rounds 11] [--against 5:8 | --against file-rows [--tile-types Q4_K,Q6_K] | --against extend
[--as-draft]]
"""

from __future__ import annotations

import benchmarks.scheduler_env  # noqa: F401  (first: the scheduler's OpenMP setting)

# isort: split
import statistics
import time

import torch

from benchmarks.common import command_line, make_parser, markdown_table
from benchmarks.host import cpu_line
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.catalog import resolve_model_path
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode, build_decode_rows
from sglite.runtime.model.gguf_block_weights import tiled_parts
from sglite.runtime.model.gguf_index import open_gguf
from sglite.runtime.model.gguf_part import TILED_TYPES, GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.loader import LoadedModel, load_model
from sglite.runtime.model.weight_arena import WeightArena

# The sequence the passes extend: this many tokens already in the KV pool, and room for at most
# MAX_ROWS rows after them.
CONTEXT_TOKENS = 200
MAX_ROWS = 64


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


class LayoutSwitch:
    """The model's GGUF weights in the layout it holds them ("built") and in the other
    ("other": tiled, or the file's rows where the model holds them tiled or in quads), each
    layout copied
    into a weight arena of its own in 2 MB pages, each with its own native decode step; `use`
    switches between them (a weight object takes the layout's parts and kernels in place, so
    every module and table holding it follows)."""

    def __init__(self, loaded: LoadedModel, types: frozenset[str] = frozenset(TILED_TYPES)) -> None:
        """`types`: the block types tiled in the other layout, where the model holds the file's
        rows."""
        self.model = loaded.model
        self.types = types
        self.weights = gguf_weights(loaded)
        gf = open_gguf(loaded.model_path)
        self.layouts: dict[str, dict[int, dict]] = {}
        self.changed = 0
        for name in ("built", "other"):
            arena = WeightArena.for_file(gf)
            self.layouts[name] = {id(w): self._copy(w, name, arena) for w in self.weights}
            arena.wait()
            move = arena.huge_page_move()
            if move is not None:
                move.run()
        self.decoders = {}
        for name in ("other", "built"):  # left as built
            self._set(name)
            self.model.weights_changed()
            self.decoders[name] = self.model._decoder()

    def _copy(self, weight: GGUFWeight, name: str, arena: WeightArena) -> dict:
        """The weight's state (its object's attributes) in layout `name`, its parts in `arena`."""
        k = weight.in_features
        file_rows = [p.as_stored() for p in weight.parts]
        parts = weight.parts if name == "built" else file_rows
        held_as_file = all(not (p.tiled or p.quads) for p in weight.parts)
        if name == "other" and held_as_file:
            parts = tiled_parts(file_rows, k, self.types, arena) or file_rows
            self.changed += parts is not file_rows
        elif name == "other":
            self.changed += 1
        placed = [p if p.tiled and name == "other" else _placed(p, arena) for p in parts]
        copy = GGUFWeight(
            placed, k, weight.scratch, weight.round_activations, weight.round_float32_extend
        )
        return dict(copy.__dict__)

    def _set(self, name: str) -> None:
        for weight in self.weights:
            weight.__dict__.update(self.layouts[name][id(weight)])

    def use(self, name: str) -> None:
        """The layout `name` ("built" or "other") for the passes that follow."""
        self._set(name)
        self.model._native_decoder = self.decoders[name]


def _held(weights: list[GGUFWeight]) -> str:
    """How the model holds its GGUF weights: some tiled, Q5_0 in quads, or the file's rows."""
    parts = [p for w in weights for p in w.parts]
    if any(p.tiled for p in parts):
        return "tiled"
    return "Q5_0 in quads" if any(p.quads for p in parts) else "the file's rows"


def _placed(part: GGUFPart, arena: WeightArena) -> GGUFPart:
    """The part placed into `arena` (its bytes there once the arena's `wait` returns)."""
    return GGUFPart(part.type_name, arena.place(part.data), tiled=part.tiled, quads=part.quads)


class Passes:
    """Decode passes of a given number of rows over one cached sequence of a model (with
    logits for every row, as a verification has, or none: `hidden_only`)."""

    def __init__(self, loaded: LoadedModel, hidden_only: bool = False) -> None:
        self.hidden_only = hidden_only
        cfg = loaded.config
        self.model = loaded.model
        self.pool = KVPool(
            CONTEXT_TOKENS + MAX_ROWS,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            loaded.dtype,
            loaded.device,
        )
        self.slots = list(range(CONTEXT_TOKENS + MAX_ROWS))
        self.table = torch.tensor(self.slots, dtype=torch.int64)

    def ms(self, rows: int) -> float:
        """One pass of `rows` DECODE rows."""
        end = CONTEXT_TOKENS + rows
        feed = [(list(range(100, 100 + rows)), CONTEXT_TOKENS, self.slots[:end], self.table[:end])]
        return self._timed(build_decode_rows(feed, self._logit_rows(rows), "cpu"))

    def extend_ms(self, rows: int) -> float:
        """One EXTEND pass over the same `rows` tokens."""
        tokens, slots = list(range(100, 100 + rows)), self.slots[: CONTEXT_TOKENS + rows]
        mode, rows_out = ForwardMode.EXTEND, self._logit_rows(rows)
        return self._timed(ForwardBatch.build(mode, [tokens], [CONTEXT_TOKENS], [slots], rows_out))

    def _logit_rows(self, rows: int) -> list[int]:
        return [] if self.hidden_only else list(range(rows))

    def _timed(self, batch: ForwardBatch) -> float:
        start = time.perf_counter()
        self.model(batch, self.pool)
        return (time.perf_counter() - start) * 1e3


class ExtendSwitch:
    """DECODE rows ("built") against one EXTEND pass ("other") of the same tokens."""

    def __init__(self, passes: Passes) -> None:
        self.passes = passes
        self.name = "built"

    def use(self, name: str) -> None:
        """Time the passes that follow as DECODE rows ("built") or as an EXTEND ("other")."""
        self.name = name

    def ms(self, rows: int) -> float:
        """One pass of `rows` tokens, the way `use` chose."""
        if self.name == "built":
            return self.passes.ms(rows)
        return self.passes.extend_ms(rows)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="GGUF path or known name")
    parser.add_argument("--rows", default="3,4,5,6,8")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--against", nargs="+", default=["5:8"], metavar="FROM:TO|file-rows")
    parser.add_argument(
        "--tile-types",
        default=",".join(sorted(TILED_TYPES)),
        help="with --against file-rows: the block types the tiled layout tiles (e.g. Q4_K)",
    )
    parser.add_argument(
        "--as-draft",
        action="store_true",
        help="with --against extend: the model loaded and run as a draft model",
    )
    args = parser.parse_args(argv)
    tile_types = frozenset(args.tile_types.split(","))
    if not tile_types <= frozenset(TILED_TYPES):
        parser.error(f"--tile-types takes some of {sorted(TILED_TYPES)}, got {args.tile_types}")
    layouts = args.against == ["file-rows"]
    extend = args.against == ["extend"]
    if args.as_draft and not extend:
        parser.error("--as-draft goes with --against extend")
    moves: dict[int, int] = {}
    if not layouts and not extend:
        try:
            moves = dict(tuple(int(n) for n in move.split(":")) for move in args.against)
        except ValueError:
            parser.error(f"--against takes FROM:TO row counts or file-rows, got {args.against}")
    rows_list = [int(r) for r in args.rows.split(",")]
    if not all(1 <= rows <= MAX_ROWS for rows in rows_list):
        parser.error(f"--rows takes counts from 1 to {MAX_ROWS}, got {args.rows}")
    path = resolve_model_path(args.model)
    as_draft = {"gemm_packing": "off", "gguf_tiles": True} if args.as_draft else {}
    loaded = load_model(path, quantization="auto", progress=False, **as_draft)
    passes = Passes(loaded, hidden_only=args.as_draft)
    switch: LayoutSwitch | ThresholdSwitch | ExtendSwitch
    if extend:
        switch = ExtendSwitch(passes)
    elif layouts:
        switch = LayoutSwitch(loaded, tile_types)
    else:
        switch = ThresholdSwitch(loaded, moves)
    timed = switch.ms if isinstance(switch, ExtendSwitch) else passes.ms
    print(command_line("benchmarks.bench_pass_rows"))
    if isinstance(switch, ExtendSwitch):
        loaded_as = "as a draft model (hidden states only)" if args.as_draft else "as served"
        print(f"host: {cpu_line()}; the model {loaded_as}; DECODE rows against one EXTEND")
    elif isinstance(switch, LayoutSwitch):
        print(
            f"host: {cpu_line()}; weights as held: {_held(switch.weights)}; {switch.changed} "
            "in the other layout"
        )
    else:
        print(f"host: {cpu_line()}; {len(switch.moved)} weights moved ({', '.join(args.against)})")
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for rows in rows_list:  # warm-up
            for name in ("built", "other"):
                switch.use(name)
                timed(rows)
        for i in range(args.rounds):
            order = ("built", "other") if i % 2 == 0 else ("other", "built")
            for rows in rows_list:
                for name in order:
                    switch.use(name)
                    times.setdefault((name, rows), []).append(timed(rows))
    table = []
    for rows in rows_list:
        a, b = (statistics.median(times[(name, rows)]) for name in ("built", "other"))
        table.append([str(rows), f"{a:.1f}", f"{b:.1f}", f"{b / a:.3f}x"])
    other = "other layout" if layouts else f"against {' '.join(args.against)}"
    other = "one EXTEND" if extend else other
    heads = ["rows", "as built (ms)", f"{other} (ms)", "other / built"]
    print(markdown_table(heads, table, right={0, 1, 2, 3}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
