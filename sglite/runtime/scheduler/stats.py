"""The scheduler's counters as one typed record, exported by `get_server_info` and `/metrics`.

Each module that counts something gets this record and adds to its fields; no other module
lists the counters (get_server_info and `/metrics` read them from here). A field with `help`
metadata is also a Prometheus counter (`prometheus_counters`), so a new counter is exported by
adding one line here.

Invariant: every field only grows (they are counters since the scheduler started).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _counter(help_text: str = "") -> int:
    """A counter field; `help_text` makes it a Prometheus counter with that help."""
    return field(default=0, metadata={"help": help_text} if help_text else {})


@dataclass
class SchedulerStats:
    """Counts since the scheduler started (see module invariant)."""

    forward_passes: int = _counter()
    prefill_passes: int = _counter()
    decode_passes: int = _counter()
    retractions: int = _counter()
    prompt_tokens: int = _counter()
    generated_tokens: int = _counter()
    finished_requests: int = _counter()
    aborted_requests: int = _counter()
    jump_forward_drafted_tokens: int = _counter(
        "Grammar-forced tokens verified (exact jump-forward)"
    )
    jump_forward_accepted_tokens: int = _counter(
        "Grammar-forced tokens the model emitted as its own"
    )
    spec_draft_tokens: int = _counter("Speculative draft tokens verified")
    spec_accepted_tokens: int = _counter("Speculative draft tokens the model emitted as its own")
    spec_verify_passes: int = _counter("Per-request verifications of a speculative draft")
    prefill_tokens_computed: int = _counter(
        "Prompt tokens run through prefill passes on this server"
    )
    disaggregation_transfers: int = _counter("Requests whose KV pages were handed over (PD)")
    disaggregation_transferred_tokens: int = _counter(
        "Prompt tokens whose KV pages were sent or received"
    )
    disaggregation_transfer_bytes: int = _counter("Bytes of KV pages sent or received")
    disaggregation_failed_transfers: int = _counter(
        "KV hand-overs that failed, timed out or were cancelled"
    )
    segment_reused_tokens: int = _counter(
        "Prompt tokens whose KV was reused from a cached segment at a new position"
    )
    segment_recomputed_tokens: int = _counter(
        "Reused segment tokens recomputed to restore their attention to the prompt before them"
    )

    def as_dict(self) -> dict[str, int]:
        """Every counter by name (get_server_info's flat keys)."""
        return dataclasses.asdict(self)

    def add(self, name: str, n: int) -> None:
        """Add `n` to the counter `name` (for callers that choose a counter by data, such as
        a draft's source); raises AttributeError for a name that is not a counter."""
        setattr(self, name, getattr(self, name) + n)


def prometheus_counters() -> list[tuple[str, str]]:
    """(name, help) of the counters `/metrics` exports."""
    return [(f.name, f.metadata["help"]) for f in dataclasses.fields(SchedulerStats) if f.metadata]
