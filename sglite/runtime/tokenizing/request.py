"""`GenerateRequest`: one prompt's generation, validated and tokenized, before it is submitted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglite.runtime.disaggregation.messages import Bootstrap
from sglite.runtime.multimodal.processor import ImageItem


@dataclass
class GenerateRequest:
    """One prompt's generation as the user asked for it (before `n` expansion).

    Invariants once built by `RequestLimits.request` (validation.py): `input_ids` is a non-empty
    list of ids in the vocabulary (or an image's pad id at one of its `images`' feature
    positions); prompt plus `max_new_tokens` fits the context and the KV pool; each segment is a
    `[start, end)` token span of `input_ids`; `sampling_params` is `SamplingParams.to_dict()`.
    """

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    pooling: str | None = None  # an embedding request ("last" or "mean")
    images: list[ImageItem] = field(default_factory=list)  # in the prompt (expanded ids)
    bootstrap: Bootstrap | None = None  # disaggregated serving: prefill server and room
    segments: list[tuple[int, int]] = field(default_factory=list)  # reusable token spans
