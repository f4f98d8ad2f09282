"""Drafts: tokens proposed ahead of the model and checked in the same forward pass.

The scheduler's decode step calls three things here:
1. a `DraftProposer` proposes, per running request, tokens likely to come next;
2. `VerifyBatch.plan` lays the step out: each request's tokens without K/V plus its draft,
   with logits at the last pending token and at every draft token (the scheduler runs them as
   one DECODE row per token);
3. `DraftVerifier.verify` walks one request's logits, emitting the model's own tokens and
   keeping draft tokens (and their K/V) while they match, and returns the `Verdict`.

Two proposers: jump-forward, exact mode (the default): where the grammar forces a continuation,
its canonical tokens are the draft; and n-gram speculation (`ngram.py`, opt-in): the tokens
that followed the last earlier occurrence of the request's latest tokens. Verification samples
position by position under the grammar mask and keeps a draft token while the sampled token
equals it, stopping at the first difference (whose sampled token is kept too). For a draft
known in advance (a point distribution), this IS the speculative-sampling rule: the draft token
is accepted with probability p(draft), and on rejection the emitted token is distributed as p
restricted to the other tokens. So outputs follow exactly the distribution of token-by-token
decoding; greedy outputs are identical, and a seeded request draws one uniform per emitted
token, as it would without drafts. This holds whatever proposes the draft (n-gram, draft
model): every emitted token is the model's own sample, and the draft only decides how many of
them one forward yields. (A verification pass has more rows than a plain step, and row count
can change a matmul's kernel, e.g. the int4 GEMV vs GEMM: logits equal to float rounding, so a
token whose top two logits tie to that precision may differ.)

Retokenize mode (SGLang's original jump-forward, kept for comparison, `RetokenizingJump`): the
forced *text* is tokenized on its own and appended unverified; the model never chose those
tokens, so what follows can drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.stats import SchedulerStats

# Longest draft verified in one forward (forced JSON keys are rarely longer): 31 and the
# request's pending token fill two 16-row tiles of the tile GEMM.
MAX_DRAFT_TOKENS = 31

# Samples one token per row of `logits` for `reqs` (row i is reqs[i]) under their grammar masks
# and appends it through the output path, which may finish the request.
SampleFn = Callable[[list[Req], torch.Tensor], None]


class DraftProposer(Protocol):
    """Proposes tokens to verify after a request's pending tokens in the next forward."""

    def propose(self, req: Req) -> list[int]:
        """The draft for `req`, empty for none.

        Invariant: `len(draft) < min(req.remaining_new_tokens, context_len - req.num_fill)`,
        so the draft plus the model's own next token fit in the request's budget and context.
        """
        ...


class ForcedTokenProposer:
    """Exact jump-forward: the tokens a request's grammar forces next."""

    def __init__(self, context_len: int, max_tokens: int = MAX_DRAFT_TOKENS) -> None:
        self.context_len = context_len
        self.max_tokens = max_tokens

    def propose(self, req: Req) -> list[int]:
        """At most `max_tokens` forced tokens (see `DraftProposer.propose` for the bound)."""
        if req.grammar is None:
            return []
        room = min(req.remaining_new_tokens, self.context_len - req.num_fill) - 1
        if room <= 0:
            return []
        return req.grammar.forced_tokens()[: min(room, self.max_tokens)]


@dataclass
class VerifyItem:
    """One request's part of a `VerifyBatch`."""

    req: Req
    draft: list[int]  # empty: a plain decode row (one logit)
    kept: int  # len(req.kv_slots) without the draft's slots
    first_row: int  # logits row after the request's last pending token


@dataclass
class VerifyBatch:
    """A decode step's tokens: each request computes its tokens without K/V (one, or more
    after a retokenizing jump) plus its draft, whose K/V slots are allocated here and become
    `req.kv_slots[item.kept:]`. Laid out as an EXTEND's flat token list (the scheduler runs it
    as one DECODE row per token, in this order).

    `logit_rows` has, per request, its last pending token then each draft token, so
    `logits[item.first_row + j]` predicts the token after `draft[:j]`.
    """

    token_ids: list[list[int]]
    prefix_lens: list[int]
    logit_rows: list[int]
    items: list[VerifyItem]

    @classmethod
    def plan(
        cls, reqs: list[Req], drafts: dict[str, list[int]], alloc: Callable[[int], list[int]]
    ) -> VerifyBatch:
        """Lay out `reqs` (drafts keyed by rid), taking their new slots from `alloc`."""
        batch = cls([], [], [], [])
        offset = 0  # of the request's first token among the batch's tokens
        for req in reqs:
            draft = drafts.get(req.rid, [])
            start = len(req.kv_slots)
            pending = req.fill_ids[start:]
            req.kv_slots.extend(alloc(len(pending) + len(draft)))
            batch.token_ids.append(pending + draft)
            batch.prefix_lens.append(start)
            batch.items.append(VerifyItem(req, draft, start + len(pending), len(batch.logit_rows)))
            last = offset + len(pending) - 1
            batch.logit_rows.extend(range(last, last + len(draft) + 1))
            offset += len(pending) + len(draft)
        return batch

    def plain(self) -> list[VerifyItem]:
        """Requests without a draft: one logit row each, sampled as a batch."""
        return [item for item in self.items if not item.draft]

    def drafted(self) -> list[VerifyItem]:
        """Requests with a draft, verified one by one."""
        return [item for item in self.items if item.draft]


@dataclass(frozen=True)
class DraftSource:
    """Where a draft came from, and the request fields and scheduler counters that tally its
    drafted and accepted tokens."""

    req_drafted: str
    req_accepted: str
    drafted_counter: str
    accepted_counter: str


JUMP_FORWARD = DraftSource(
    "jump_forward_drafted",
    "jump_forward_accepted",
    "jump_forward_drafted_tokens",
    "jump_forward_accepted_tokens",
)
SPECULATION = DraftSource(
    "spec_drafted", "spec_accepted", "spec_draft_tokens", "spec_accepted_tokens"
)


def _tally(req: Req, stats: SchedulerStats, field: str, counter: str, n: int) -> None:
    setattr(req, field, getattr(req, field) + n)
    stats.add(counter, n)


@dataclass(frozen=True)
class Verdict:
    """How much of a draft the model emitted."""

    draft: list[int]
    accepted: int  # leading draft tokens the model emitted as its own

    @property
    def accepted_tokens(self) -> list[int]:
        """The draft tokens now in the request's output."""
        return self.draft[: self.accepted]


class DraftVerifier:
    """Checks drafts against the logits of the forward that computed them."""

    def __init__(self, pool: KVPool, stats: SchedulerStats) -> None:
        self.pool = pool
        self.stats = stats  # tallies each draft's `DraftSource` counters

    def verify(
        self,
        req: Req,
        draft: list[int],
        kept: int,
        logits: torch.Tensor,
        sample: SampleFn,
        source: DraftSource = JUMP_FORWARD,
    ) -> Verdict:
        """Emit the model's tokens position by position, keeping draft tokens while they match.

        `logits` has `len(draft) + 1` rows, `logits[j]` predicting the token after `draft[:j]`;
        `req.kv_slots[kept:]` hold the draft's K/V. Afterwards `req.kv_slots` ends with the slots
        of the draft tokens kept (unless the request finished); the others are freed.
        """
        spare = req.kv_slots[kept:]
        del req.kv_slots[kept:]
        req.slot_mirror.truncate(kept)
        _tally(req, self.stats, source.req_drafted, source.drafted_counter, len(draft))
        accepted = 0
        used = 0  # draft slots whose K/V now belong to an output token
        try:
            for j in range(len(draft) + 1):
                emitted = len(req.output_ids)
                sample([req], logits[j : j + 1])
                # A sample that failed the request appended nothing: no token to compare.
                grew = len(req.output_ids) > emitted
                matched = grew and j < len(draft) and req.output_ids[-1] == draft[j]
                if matched:
                    accepted += 1
                    _tally(req, self.stats, source.req_accepted, source.accepted_counter, 1)
                if req.finished or not matched:
                    break
                # draft[j] is now an output token, so its K/V (already written) is the
                # request's; owned before the next token, which may finish the request and
                # cache its slots.
                req.kv_slots.append(spare[j])
                used += 1
        finally:  # also when sampling raises (the step then fails): no slot is left unowned
            self.pool.free(spare[used:])
        return Verdict(draft, accepted)


class RetokenizingJump:
    """SGLang's original jump-forward: the forced text's own tokens, appended unverified."""

    def __init__(self, encode: Callable[[str], list[int]], stats: SchedulerStats) -> None:
        self.encode = encode  # text -> token ids, without special tokens
        # Drafted and accepted are both the forced tokens: none is checked.
        self.stats = stats

    def forced_tokens(self, req: Req) -> list[int]:
        """The forced text, tokenized on its own, as far as the grammar takes those tokens (the
        boundary may differ from what the model would write)."""
        if req.grammar is None:
            return []
        forced = req.grammar.forced_text()
        if not forced:
            return []
        text = forced.decode("utf-8", errors="ignore")
        if not text:
            return []
        tokens = self.encode(text)
        room = max(0, req.remaining_new_tokens - 1)
        tokens = tokens[:room]
        return tokens[: req.grammar.count_allowed(tokens)]

    def jump(self, req: Req, append: Callable[[Req, int], None]) -> None:
        """Append `req`'s forced tokens through `append(req, token)` until one finishes it."""
        tokens = self.forced_tokens(req)
        req.jump_forward_drafted += len(tokens)
        req.jump_forward_accepted += len(tokens)
        self.stats.jump_forward_drafted_tokens += len(tokens)
        self.stats.jump_forward_accepted_tokens += len(tokens)
        for tok in tokens:
            if req.finished:
                break
            append(req, tok)
