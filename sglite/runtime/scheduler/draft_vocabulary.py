"""The draft model's greedy token chosen among a frequent part of the vocabulary.

A small draft model spends much of its pass on the output projection: the Qwen2.5-Coder 0.5B's
151,936-row head is about 40% of the bytes it reads per token. Its draft only has to be a good
guess (the target verifies every token, so outputs never depend on it), and the tokens a model
writes are mostly frequent ones: a byte-level BPE numbers its tokens in merge order, so its
first ids are its most frequent pieces (the Qwen tokenizer's first 32,768 cover 98% of the
tokens of the benchmarks' prompts and answers). As in FR-Spec (Zhao et al., 2025), the draft's
logits are computed for those rows only (a view of the head's own blocks: no copy), plus the
tokenizer's added tokens (end of turn, tool-call markers) and the request's prompt tokens past
them (what a copying answer needs): each request's few extra rows are copied once, as blocks,
into a weight of their own.

Invariant: `choose_many` returns the argmax of the logits the whole head would give over the ids
`allowed_for` the request: both weights are the head's own blocks through the same kernel,
whose every output row depends on its weight row and x alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglite.runtime.model.gguf_weight import GGUFPart, GGUFWeight


def greedy_choice(logits: torch.Tensor) -> tuple[int, float]:
    """The argmax of a row of logits (the lowest index among equals) and its softmax
    probability."""
    best = int(torch.argmax(logits))
    return best, float(torch.softmax(logits.float(), dim=0)[best])


@dataclass
class RequestRows:
    """One request's extra candidates: token ids past the prefix and their head rows."""

    ids: list[int]
    weight: GGUFWeight | None  # rows `ids` of the head, as its blocks (None: no extra id)


class DraftVocabulary:
    """Greedy draft tokens over the head's first `size` rows and a request's extra ids."""

    def __init__(self, head: GGUFWeight, size: int, added_ids: list[int]) -> None:
        if len(head.parts) != 1 or not 0 < size < head.out_features:
            raise ValueError(f"a draft vocabulary of {size} tokens is not part of this head")
        self.head = head
        self.size = size
        self.prefix = self._weight(head.parts[0].data[:size])
        self.added_ids = sorted({i for i in added_ids if size <= i < head.out_features})

    @classmethod
    def for_model(cls, head: object, size: int, added_ids: list[int]) -> DraftVocabulary | None:
        """The vocabulary for a draft model's `head`, or None where the whole head is used:
        `size` 0, a size not below the head's rows, a head not held as one tensor's GGUF
        blocks."""
        if size <= 0 or not isinstance(head, GGUFWeight) or len(head.parts) != 1 or head.tiled:
            return None
        return cls(head, size, added_ids) if size < head.out_features else None

    def rows_for(self, prompt_ids: list[int]) -> RequestRows:
        """The extra candidates of a request with this prompt: the added tokens and the
        prompt's own ids at or past the prefix."""
        extra = set(self.added_ids) | {t for t in prompt_ids if t >= self.size}
        ids = sorted(t for t in extra if t < self.head.out_features)
        if not ids:
            return RequestRows([], None)
        return RequestRows(ids, self._weight(self.head.parts[0].data[np.array(ids)]))

    def allowed_for(self, request: RequestRows) -> list[int]:
        """Every id `choose_many` can return for this request."""
        return list(range(self.size)) + request.ids

    def choose_many(
        self, hidden: torch.Tensor, requests: list[RequestRows], dtype: torch.dtype
    ) -> list[tuple[int, float]]:
        """Per row i of `hidden` ([n, hidden], after the final norm): the argmax of its logits
        over `allowed_for(requests[i])` (the lowest id among equals), and its probability under
        a softmax over those ids; `dtype`: the model's activations'. The shared prefix's logits
        come from one product for all rows."""
        x = hidden.to(dtype)
        prefix = self.prefix.matmul_decode(x)
        chosen = []
        for i, request in enumerate(requests):
            logits = prefix[i]
            if request.weight is not None:
                logits = torch.cat([logits, request.weight.matmul_decode(x[i : i + 1])[0]])
            best, probability = greedy_choice(logits)
            token = best if best < self.size else request.ids[best - self.size]
            chosen.append((token, probability))
        return chosen

    def _weight(self, rows: np.ndarray) -> GGUFWeight:
        head = self.head
        part = GGUFPart(head.parts[0].type_name, np.ascontiguousarray(rows))
        return GGUFWeight([part], head.in_features, head.scratch, head.round_activations)
