"""One line of bench_engine's results table (`Row`), a line saying why a figure is missing, and
the list that prints each line as it is measured."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.common import PeerStatus


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
