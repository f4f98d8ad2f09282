"""benchmarks/bench_pass_rows.py on the default model: under the other thresholds the weights
asked for (and only those) take the VNNI GEMM from the row counts given, each native decode step
holding its own; the other layout holds the weights the VNNI GEMM serves tiled (or in the
file's rows where they are held tiled), the same products; DECODE rows are timed against one
EXTEND pass; and the table has one row of positive timings per row count."""

from __future__ import annotations

import pytest
import torch
from test_gguf_activations import VNNI_GEMM

from benchmarks import bench_pass_rows
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.loader import default_tiled_types, load_model

# Whether the default model's Q8_0 head is held tiled as loaded (blocks of 32 are, where the
# VNNI GEMM serves every product); the other layout is then the file's rows.
HEAD_HELD_TILED = "Q8_0" in default_tiled_types()


def test_the_other_thresholds_apply_to_the_moved_weights_only_while_used():
    loaded = load_model("smollm2-135m", quantization="auto", progress=False)
    gate_up = loaded.model.layers[0].mlp.gate_up_proj.quantized
    head = loaded.model.lm_head_quantized
    assert isinstance(gate_up, GGUFWeight) and isinstance(head, GGUFWeight)
    built, head_built = gate_up.a8_gemm_min_rows, head.a8_gemm_min_rows
    switch = bench_pass_rows.ThresholdSwitch(loaded, {built: 7})
    # every layer's gate_up has the same block type, so each moves (the head only with them)
    assert len(switch.moved) >= loaded.config.num_layers
    switch.use("other")
    assert gate_up.a8_gemm_min_rows == 7
    assert head.a8_gemm_min_rows == (7 if head_built == built else head_built)
    switch.use("built")
    assert (gate_up.a8_gemm_min_rows, head.a8_gemm_min_rows) == (built, head_built)
    # each native decode step's tables hold its own thresholds
    tables = {name: decoder.tables[True][0] for name, decoder in switch.decoders.items()}
    assert tables["built"][0].gate_up.a8_gemm_min_rows == built
    assert tables["other"][0].gate_up.a8_gemm_min_rows == 7


def test_the_table_has_a_row_per_row_count(capsys):
    argv = ["--model", "smollm2-135m", "--rows", "1,5", "--rounds", "1", "--against", "4:8"]
    assert bench_pass_rows.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in row] for row in rows]
    assert [row[0] for row in cells] == ["1", "5"]
    for _, built_ms, other_ms, ratio in cells:
        assert float(built_ms) > 0 and float(other_ms) > 0 and ratio.endswith("x")
    assert "weights moved (4:8)" in out


def test_decode_rows_against_one_extend_as_a_draft_model(capsys):
    """`--against extend --as-draft`: the model loaded as a draft model is, the same rows timed
    as DECODE rows and as one EXTEND, a table row per row count."""
    argv = ["--model", "smollm2-135m", "--rows", "1,24", "--rounds", "1", "--against", "extend"]
    assert bench_pass_rows.main([*argv, "--as-draft"]) == 0
    out = capsys.readouterr().out
    assert "as a draft model (hidden states only); DECODE rows against one EXTEND" in out
    assert "| one EXTEND (ms) |" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    assert [row[0].strip() for row in rows] == ["1", "24"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)


def test_as_draft_without_extend_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_pass_rows.main(["--model", "smollm2-135m", "--as-draft"])
    assert exit_.value.code == 2
    assert "--as-draft goes with --against extend" in capsys.readouterr().err


def test_more_rows_than_the_pool_holds_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_pass_rows.main(["--model", "smollm2-135m", "--rows", "4,96"])
    assert exit_.value.code == 2
    assert "--rows takes counts from 1 to 64, got 4,96" in capsys.readouterr().err


def test_a_malformed_move_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_pass_rows.main(["--model", "smollm2-135m", "--against", "five"])
    assert exit_.value.code == 2
    assert "--against takes FROM:TO row counts" in capsys.readouterr().err


def test_the_other_layout_tiles_what_the_vnni_gemm_serves_and_computes_the_same():
    """The default model's Q8_0 head is tiled in one layout where the VNNI GEMM serves it (as
    loaded where blocks of 32 are tiled by default, else in the other layout; its Q4_1
    projections never), and a pass's logits are the same in both layouts at 3 rows, where
    both take the GEMM."""
    loaded = load_model("smollm2-135m", quantization="auto", progress=False)
    head = loaded.model.lm_head_quantized
    assert isinstance(head, GGUFWeight) and head.tiled == HEAD_HELD_TILED
    switch = bench_pass_rows.LayoutSwitch(loaded)
    passes = bench_pass_rows.Passes(loaded)
    logits = {}
    for name in ("other", "built"):
        switch.use(name)
        other_tiled = VNNI_GEMM and not HEAD_HELD_TILED
        assert head.tiled == (HEAD_HELD_TILED if name == "built" else other_tiled)
        feed = [(list(range(100, 103)), 200, passes.slots[:203], passes.table[:203])]
        batch = bench_pass_rows.build_decode_rows(feed, [0, 1, 2], "cpu")
        with torch.inference_mode():
            logits[name] = loaded.model(batch, passes.pool)
    assert switch.changed == (1 if VNNI_GEMM and not HEAD_HELD_TILED else 0)
    if head.a8_gemm_min_rows <= 3:
        assert torch.equal(logits["other"], logits["built"])


def test_the_layout_table_has_a_row_per_row_count(capsys):
    argv = ["--model", "smollm2-135m", "--rows", "1,3", "--rounds", "1", "--against", "file-rows"]
    assert bench_pass_rows.main(argv) == 0
    out = capsys.readouterr().out
    held = "tiled" if HEAD_HELD_TILED else "the file's rows"
    assert f"weights as held: {held}" in out and "other layout (ms)" in out
