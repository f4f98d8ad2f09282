"""bench_footprint's table: the starts of each model and server summed up as one row (medians
over rounds, the highest peak), and the Markdown table with sglite / llama.cpp ratios."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.common import markdown_table
from benchmarks.footprint_memory import GB
from benchmarks.footprint_servers import LLAMA, SGLITE, Start


@dataclass
class Row:
    """One model and server: medians over rounds (memory from the SECOND starts, else FIRST);
    the peak is the highest sampled over all its starts."""

    model: str
    server: str
    status: str
    first_ready_s: float | None
    second_ready_s: float | None
    rss_gb: float | None
    pss_gb: float | None
    anon_gb: float | None
    peak_rss_gb: float | None
    starts: int


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(starts: list[Start]) -> list[Row]:
    """Rows per (model, server), in the order first seen."""
    rows = []
    keys = list(dict.fromkeys((s.model, s.server) for s in starts))
    for model, server in keys:
        mine = [s for s in starts if (s.model, s.server) == (model, server)]
        ok = [s for s in mine if s.status == "ok"]
        # A crash names its exit code and log in the table too, not only in the list below it.
        bad = sorted(
            {s.status if s.status != "crashed" else f"crashed ({s.detail})" for s in mine} - {"ok"}
        )
        status = "ok" if not bad else ("ok, " if ok else "") + "/".join(bad)
        mem = [s for s in ok if s.kind == "second"] or ok
        rows.append(
            Row(
                model,
                server,
                status,
                _median([s.ready_s for s in ok if s.kind == "first"]),
                _median([s.ready_s for s in ok if s.kind == "second"]),
                _median([s.rss / GB for s in mem]),
                _median([s.pss / GB for s in mem]),
                _median([s.anon / GB for s in mem]),
                max([s.peak_rss / GB for s in mine if s.peak_rss], default=None),
                len(mine),
            )
        )
    return rows


def _fmt(v: float | None, spec: str = "{:.2f}") -> str:
    return "-" if v is None else spec.format(v)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(rows: list[Row]) -> str:
    """Markdown table; the ratio columns sit on sglite's row (sglite / llama.cpp)."""
    heads = [
        "model", "server", "status", "first-start ready (s)", "second-start ready (s)",
        "RSS (GB)", "PSS (GB)", "anon RSS (GB)", "peak RSS (GB)", "RSS sglite/llama",
        "PSS sglite/llama",
    ]  # fmt: skip
    peers = {(r.model, r.server): r for r in rows}
    cells = []
    for r in rows:
        peer = peers.get((r.model, LLAMA)) if r.server == SGLITE else None
        rss_x = _ratio(r.rss_gb, peer.rss_gb) if peer else ""
        pss_x = _ratio(r.pss_gb, peer.pss_gb) if peer else ""
        cells.append(
            [r.model, r.server, r.status, _fmt(r.first_ready_s), _fmt(r.second_ready_s),
             _fmt(r.rss_gb), _fmt(r.pss_gb), _fmt(r.anon_gb), _fmt(r.peak_rss_gb), rss_x, pss_x]
        )  # fmt: skip
    return markdown_table(heads, cells, right=range(3, len(heads)), pad=False)
