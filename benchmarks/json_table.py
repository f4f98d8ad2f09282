"""The JSON benchmark's table: each configuration's label and the Markdown table of the runs,
with ratios against token-by-token on the same variant."""

from __future__ import annotations

from benchmarks.common import markdown_table
from benchmarks.json_results import Run

LABELS = {
    "none": "sglite token-by-token",
    "exact": "sglite exact jump-forward",
    "retokenize": "sglite retokenize jump-forward",
    "free": "sglite unconstrained",
    "llama": "llama.cpp llama-server",
}


def _fmt(value: object, spec: str = "{}") -> str:
    return "–" if value is None else spec.format(value)


def table(runs: list[Run]) -> str:
    """A Markdown table, with speed-ups against token-by-token on the same variant."""
    if not runs:
        return "(no results)"
    base = {r.variant: r for r in runs if r.config == "none"}
    heads = [
        "configuration", "constraint", "wall s", "docs/s", "out tok/s", "CPU s", "fwd passes",
        "drafted", "accepted", "valid", "JSON ok", "fields right", "differ (text/ids)",
        "docs/s vs tbt", "CPU vs tbt", "passes vs tbt",
    ]  # fmt: skip
    rows = []
    for r in runs:
        if r.status:
            label = [LABELS[r.config], "none" if r.variant == "free" else r.variant]
            rows.append([*label, r.status, *["-"] * (len(heads) - 3)])
            continue
        b = base.get(r.variant)
        speed = passes = cpu = None
        if b is not None:
            speed = f"{(r.docs / r.wall_s) / (b.docs / b.wall_s):.2f}x"
            if r.cpu_s and b.cpu_s:
                cpu = f"{r.cpu_s / b.cpu_s:.2f}x"
            if r.forward_passes is not None and b.forward_passes:
                passes = f"{r.forward_passes / b.forward_passes:.2f}x"
        differ = None
        if r.differ_text is not None:
            differ = f"{r.differ_text}/{_fmt(r.differ_ids)}"
        rows.append(
            [
                LABELS[r.config],
                "none" if r.variant == "free" else r.variant,
                f"{r.wall_s:.1f}",
                f"{r.docs / r.wall_s:.2f}",
                f"{r.out_tokens / r.wall_s:.1f}",
                _fmt(r.cpu_s, "{:.1f}"),
                _fmt(r.forward_passes),
                _fmt(r.drafted),
                _fmt(r.accepted),
                f"{r.valid}/{r.docs}",
                f"{r.json_ok}/{r.docs}",
                f"{100 * r.correct_fields / max(1, r.total_fields):.0f}%",
                _fmt(differ),
                _fmt(speed),
                _fmt(cpu),
                _fmt(passes),
            ]
        )
    return markdown_table(heads, rows, right=range(2, len(heads)))
