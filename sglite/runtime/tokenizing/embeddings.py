"""Embedding requests: a prompt run for its pooled final hidden states, no tokens generated.

An embedding request is a generate request with `max_new_tokens` 0 and `pooling` set (the
scheduler then gathers the hidden rows, scheduler/pooling.py); its result is
`{"embedding", "meta_info"}` instead of text and ids.
"""

from __future__ import annotations

from typing import Any

from sglite.runtime.tokenizing.request import GenerateRequest


def embedding_sampling_params() -> dict[str, Any]:
    """The sampling parameters of an embedding request (a fresh dict)."""
    return {"max_new_tokens": 0}


def mark_pooled(reqs: list[GenerateRequest], pooling: str | None) -> None:
    """Make `reqs` embedding requests pooled the server's way (`--pooling`: last or mean)."""
    for req in reqs:
        req.pooling = pooling


def embedding_result(embedding: list[float] | None, meta: dict[str, Any]) -> dict[str, Any]:
    """An embedding request's SGLang-shaped result."""
    return {"embedding": embedding, "meta_info": meta}
