"""The draft model's K/V of the requests it drafts for, and the passes that fill it.

`DraftKV` owns the draft model, its `KVPool` and its `RadixCache`: a `DraftSequence` per
request holds the K/V of the request's tokens (and of the last draft's, until the next draft
cuts them back to the tokens the target kept); a request that ends leaves its verified tokens in
the cache, so a later prompt with the same prefix costs the draft model nothing, and a prompt
just read is cached at once (`share`) for the requests running beside it.
`draft_model.DraftModelProposer` decides when and how far to draft; this module runs the passes.

Invariant (`check_invariants`): every slot of the pool is free, cached, or held by exactly one
live sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.model.causal_lm import CausalLM
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode, build_decode_rows
from sglite.runtime.scheduler.draft_model_state import DraftSequence
from sglite.runtime.scheduler.draft_vocabulary import DraftVocabulary, greedy_choice
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.speculation import DraftLength

if TYPE_CHECKING:
    from sglite.runtime.model.loader import LoadedModel

# A pass of at most this many tokens (a draft's next tokens, a request's catch-up on the tokens
# since its last draft) runs as DECODE rows, one per token; longer ones (a prompt) as an EXTEND.
DECODE_ROWS_MAX = 32


class DraftKV:
    """The draft model with its KV pool and radix cache (see the module docstring)."""

    def __init__(
        self,
        draft: LoadedModel,
        context_len: int,
        capacity: int,
        vocab: DraftVocabulary | None = None,
    ) -> None:
        cfg = draft.config
        self.model: CausalLM = draft.model
        self.dtype = draft.dtype
        self.device = draft.device
        self.vocab = vocab  # None: drafts chosen over the whole head
        self.vocab_size = cfg.vocab_size
        self.context_len = context_len
        self.pool = KVPool(
            capacity, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, draft.dtype, draft.device
        )
        self.cache = RadixCache(self.pool)
        self.forward_passes = 0

    def start(self, req: Req, length: DraftLength) -> DraftSequence:
        """A new sequence for `req`, its drafts sized by `length`, holding the draft cache's
        longest match of the prompt (all but its last token, whose logits the first proposal
        needs)."""
        match = self.cache.match_prefix(req.prompt_ids[:-1])
        self.cache.lock(match.node)
        cached = len(match.slots)
        seq = DraftSequence(length, match.node)
        if self.vocab is not None:
            seq.extra = self.vocab.rows_for(req.prompt_ids)
        seq.tokens, seq.slots = list(req.prompt_ids[:cached]), list(match.slots)
        seq.cached_len = seq.verified = cached
        return seq

    def rewind(self, seq: DraftSequence, target: list[int], keep: int) -> None:
        """Cut `seq` back to the `keep` tokens of it that are in `target` (the request's
        tokens; `DraftSequence.held`)."""
        self.pool.free(seq.slots[keep:])
        seq.cut(keep)
        seq.verified = len(target)  # the tokens fed next are the request's own

    def extend(self, seq: DraftSequence, feed: list[int]) -> tuple[int, float] | None:
        """`extend_many` of one sequence."""
        return self.extend_many([(seq, feed)])[0]

    def extend_many(
        self, items: list[tuple[DraftSequence, list[int]]]
    ) -> list[tuple[int, float] | None]:
        """Run the draft model over each `feed` after its sequence's tokens, all in one pass;
        per item its greedy next token and that token's probability, None where the pool has
        no room for `feed` or the context is full (that item is left out of the pass)."""
        runs = [(seq, feed, self._append(seq, feed)) for seq, feed in items]
        batch_items = [(seq, feed, start) for seq, feed, start in runs if start is not None]
        if not batch_items:
            return [None] * len(items)
        feeds = [feed for _, feed, _ in batch_items]
        ends = list(itertools.accumulate(len(feed) for feed in feeds))
        last = [end - 1 for end in ends]
        logit_rows = [] if self.vocab is not None else last
        if ends[-1] <= DECODE_ROWS_MAX:  # on the decode path, one row per token
            feeds_at = [
                (feed, start, seq.slots, seq.slot_mirror.view(seq.slots))
                for seq, feed, start in batch_items
            ]
            batch = build_decode_rows(feeds_at, logit_rows, self.device)
        else:
            starts = [start for _, _, start in batch_items]
            slots = [seq.slots for seq, _, _ in batch_items]
            batch = ForwardBatch.build(
                ForwardMode.EXTEND, feeds, starts, slots, logit_rows, self.device
            )
        if self.vocab is not None:  # the final hidden states, for the draft vocabulary's rows
            batch.hidden_rows = torch.tensor(last, dtype=torch.long, device=self.device)
        self.forward_passes += 1
        try:
            logits = self.model(batch, self.pool)
        except BaseException:  # the K/V of the feeds was not (fully) written: never keep it
            for seq, _, start in batch_items:
                self.pool.free(seq.slots[start:])
                seq.cut(start)
            raise
        if self.vocab is None:
            chosen = [greedy_choice(row) for row in logits]
        else:
            assert batch.hidden is not None
            extras = [seq.extra for seq, _, _ in batch_items]
            chosen = self.vocab.choose_many(batch.hidden, extras, self.dtype)  # type: ignore[arg-type]
        found = iter(chosen)
        return [next(found) if start is not None else None for _, _, start in runs]

    def _append(self, seq: DraftSequence, feed: list[int]) -> int | None:
        """Slots for `feed` after `seq`'s tokens (the cache evicted for room), `feed` appended;
        the position it starts at, or None (nothing changed) when it does not fit."""
        if not feed or len(seq.tokens) + len(feed) > self.context_len:
            return None
        if self.pool.num_free < len(feed):
            self.cache.evict(len(feed) - self.pool.num_free)
            if self.pool.num_free < len(feed):
                return None
        start = len(seq.tokens)
        seq.tokens.extend(feed)
        seq.slots.extend(self.pool.alloc(len(feed)))
        return start

    def share(self, seq: DraftSequence) -> None:
        """Cache the verified tokens of `seq` now (a prompt just read), so that requests
        running beside it with the same prefix (a batch of one system prompt or document)
        read it from the cache instead of each passing over it: `seq` then holds them through
        the cache (its lock moved to their node), its own duplicates of tokens another request
        cached meanwhile freed."""
        verified = min(seq.verified, len(seq.tokens))
        if verified <= seq.cached_len:
            return
        already = self.cache.insert(seq.tokens[:verified], seq.slots[:verified])
        self.pool.free(seq.slots[seq.cached_len : already])
        match = self.cache.match_prefix(seq.tokens[:verified])
        self.cache.lock(match.node)
        self.cache.unlock(seq.node)
        seq.slots = list(match.slots) + seq.slots[verified:]  # a new list: the mirror resyncs
        seq.node, seq.cached_len = match.node, verified

    def release(self, seq: DraftSequence) -> None:
        """Cache the verified tokens of `seq` (a request that ended) and free its other slots."""
        verified = min(seq.verified, len(seq.tokens))
        already = self.cache.insert(seq.tokens[:verified], seq.slots[:verified])
        self.pool.free(seq.slots[seq.cached_len : already])
        self.pool.free(seq.slots[verified:])
        self.cache.unlock(seq.node)

    def flush(self) -> None:
        """Empty the cache (every sequence released first: the caller's to ensure)."""
        self.cache.flush()

    def check_invariants(self, sequences: Iterable[DraftSequence]) -> None:
        """Free + cached + held by `sequences` (every live one) == the pool's capacity; raises
        otherwise."""
        self.cache.check_invariants()
        held = sum(len(seq.slots) - seq.cached_len for seq in sequences)
        total = self.pool.num_free + self.cache.total_size() + held
        assert total == self.pool.capacity, (
            f"draft pool: {self.pool.num_free} free + {self.cache.total_size()} cached + "
            f"{held} held != {self.pool.capacity}"
        )
