"""The JSON benchmark's results: one configuration's measured run on one variant, the best of
repeated runs, and the checks of its outputs (validity, JSON parse, fields right, and outputs
that differ from token-by-token's)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from benchmarks.json_documents import Doc, constraint_params


@dataclass
class Run:
    """One configuration on one variant."""

    config: str
    variant: str
    wall_s: float
    docs: int
    out_tokens: int
    texts: list[str]
    cpu_s: float | None = None  # CPU time of the model process (scheduler / llama-server)
    ids: list[list[int]] | None = None
    forward_passes: int | None = None
    decode_passes: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    valid: int = 0
    json_ok: int = 0
    correct_fields: int = 0
    total_fields: int = 0
    differ_text: int | None = None
    differ_ids: int | None = None
    notes: list[str] = field(default_factory=list)
    status: str = ""  # why there are no figures (a peer's `PeerStatus.cell()`): not measured


def score(run: Run, docs: list[Doc]) -> None:
    """Fill validity, parse and field-accuracy counts from the outputs."""
    for doc, text in zip(docs, run.texts, strict=True):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        run.json_ok += obj is not None
        if run.variant == "regex":
            run.valid += re.fullmatch(doc.kind.regex(), text) is not None
        else:
            run.valid += obj is not None and doc.kind.check(obj)
        run.total_fields += len(doc.truth)
        if isinstance(obj, dict):
            run.correct_fields += sum(obj.get(k) == v for k, v in doc.truth.items())


def compare(run: Run, base: Run, docs: list[Doc]) -> None:
    """Count outputs that differ from the token-by-token run; describe the first one."""
    run.differ_text = sum(a != b for a, b in zip(run.texts, base.texts, strict=True))
    if run.ids is not None and base.ids is not None:
        run.differ_ids = sum(a != b for a, b in zip(run.ids, base.ids, strict=True))
    if run.config != "exact" or not (run.differ_text or run.differ_ids):
        return
    for i, (a, b) in enumerate(zip(run.ids or [], base.ids or [], strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            run.notes.append(
                f"exact jump-forward differs from token-by-token on doc {i} ({run.variant}) at "
                f"output token {at}:\n  exact: {run.texts[i]!r}\n  token-by-token: "
                f"{base.texts[i]!r}\n  prompt: {docs[i].prompt!r}\n  constraint: "
                f"{constraint_params(docs[i], run.variant)!r}"
            )
            break


def best_of(tries: list[Run]) -> Run:
    """The fastest of repeated runs, with the least CPU time of any of them."""
    best = min(tries, key=lambda r: r.wall_s)
    cpus = [r.cpu_s for r in tries if r.cpu_s is not None]
    best.cpu_s = min(cpus) if cpus else None
    return best
