"""The draft model's greedy token chosen among a frequent part of the vocabulary.

A small draft model spends much of its pass on the output projection: the Qwen2.5-Coder 0.5B's
151,936-row head is about 40% of the bytes it reads per token. Its draft only has to be a good
guess (the target verifies every token, so outputs never depend on it), and the tokens a model
writes are mostly frequent ones: a byte-level BPE numbers its tokens in merge order, so its
first ids are its most frequent pieces (the Qwen tokenizer's first 32,768 cover 98% of the
tokens of the benchmarks' prompts and answers). As in FR-Spec (Zhao et al., 2025), the draft's
logits are computed for those rows only (a view of the head's own blocks: no copy), plus the
tokenizer's added tokens (end of turn, tool-call markers) and the request's prompt tokens past
them (what a copying answer needs), each with its other spelling as to a leading space (a
prompt's " seller" is a JSON record's "seller": `SpaceVariants`), and the tokens past the prefix
the request has written (an edit's new name, a closing code fence: what it wrote once it tends
to write again). A request's extra rows are copied, as blocks, into a weight of their own, again
when its output brings a new id (a few times per request in the benchmarks' answers; text of
rare tokens brings more, each a copy of the request's extra rows).

Invariant: `choose_many` returns the argmax of the logits the whole head would give over the ids
`allowed_for` the request: both weights are the head's own blocks through the same kernel,
whose every output row depends on its weight row and x alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from sglite.runtime.model.gguf_part import GGUFPart
from sglite.runtime.model.gguf_weight import GGUFWeight


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
    read: int = 0  # how many of the request's tokens `with_written` has looked at
    held: frozenset[int] = field(init=False)  # `ids`, for lookups

    def __post_init__(self) -> None:
        self.held = frozenset(self.ids)


# The marks that byte-level BPE ("Ġ") and SentencePiece ("▁") vocabularies write a leading
# space as, in the order they are looked for.
SPACE_MARKS = ("\u0120", "\u2581")


@dataclass
class SpaceVariants:
    """Each token's other spelling as to a leading space ("Ġseller" and "seller"), where the
    vocabulary has that as one token: a word a prompt writes after a space, an answer often
    writes after a quote or a bracket. Looked up per token as asked, and remembered."""

    piece_of: Callable[[int], str | None]  # a token's vocabulary string
    id_of: Callable[[str], int | None]  # a vocabulary string's token
    mark: str
    found: dict[int, int | None] = field(default_factory=dict)

    @classmethod
    def for_tokenizer(cls, tokenizer: object) -> SpaceVariants | None:
        """The variants in `tokenizer`'s vocabulary (its `convert_ids_to_tokens` and
        `token_to_id`), or None where it marks no leading space as SPACE_MARKS do."""
        id_of = getattr(tokenizer, "token_to_id", None)
        pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
        if id_of is None or pieces is None:
            return None
        for mark in SPACE_MARKS:
            if id_of(mark + "the") is not None:
                return cls(lambda token: pieces([token])[0], id_of, mark)
        return None

    def of(self, token: int) -> int | None:
        """`token`'s other spelling, or None."""
        if token not in self.found:
            piece = self.piece_of(token)
            other = None
            if piece:
                bare = piece.removeprefix(self.mark)
                other = self.id_of(bare if bare != piece else self.mark + piece)
            self.found[token] = other if other != token else None
        return self.found[token]


class DraftVocabulary:
    """Greedy draft tokens over the head's first `size` rows and a request's extra ids."""

    def __init__(
        self,
        head: GGUFWeight,
        size: int,
        added_ids: list[int],
        variants: SpaceVariants | None = None,
    ) -> None:
        if len(head.parts) != 1 or not 0 < size < head.out_features:
            raise ValueError(f"a draft vocabulary of {size} tokens is not part of this head")
        self.head = head
        self.size = size
        self.prefix = self._weight(head.parts[0].data[:size])
        self.added_ids = sorted({i for i in added_ids if size <= i < head.out_features})
        self.variants = variants  # None: no other spellings taken

    @classmethod
    def for_model(
        cls,
        head: object,
        size: int,
        added_ids: list[int],
        variants: SpaceVariants | None = None,
    ) -> DraftVocabulary | None:
        """The vocabulary for a draft model's `head`, or None where the whole head is used:
        `size` 0, a size not below the head's rows, a head not held as one tensor's GGUF
        blocks."""
        if size <= 0 or not isinstance(head, GGUFWeight) or len(head.parts) != 1 or head.tiled:
            return None
        return cls(head, size, added_ids, variants) if size < head.out_features else None

    def rows_for(self, prompt_ids: list[int]) -> RequestRows:
        """The extra candidates of a request with this prompt: the added tokens, and the
        prompt's own ids and their other spellings (`SpaceVariants`) at or past the prefix."""
        return self._rows(set(self.added_ids) | self._past_prefix(set(prompt_ids)), len(prompt_ids))

    def with_written(self, request: RequestRows, tokens: list[int]) -> RequestRows:
        """`request`'s candidates once the request's tokens are `tokens` (its prompt and
        output): its own, and the ids past the prefix (and their other spellings) among the
        tokens it has not looked at; `request` itself where those bring none."""
        unread = tokens[request.read :]
        request.read = len(tokens)
        new = self._past_prefix(set(unread)) - request.held if unread else set()
        return self._rows(request.held | new, len(tokens)) if new else request

    def _past_prefix(self, tokens: Iterable[int]) -> set[int]:
        """Of `tokens` and their other spellings, the ids past the prefix, within the head
        (no negative id, such as an image's pad, is looked up)."""
        spelled = {t for t in tokens if t >= 0}
        if self.variants is not None:
            spelled |= {v for t in list(spelled) if (v := self.variants.of(t)) is not None}
        return {t for t in spelled if self.size <= t < self.head.out_features}

    def _rows(self, ids: set[int] | frozenset[int], read: int) -> RequestRows:
        if not ids:
            return RequestRows([], None, read)
        ordered = sorted(ids)
        rows = self._weight(self.head.parts[0].data[np.array(ordered)])
        return RequestRows(ordered, rows, read)

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
