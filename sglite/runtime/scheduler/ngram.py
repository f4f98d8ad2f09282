"""N-gram (prompt lookup) speculation: drafts copied from text already seen.

Where a request is repeating or quoting what it has seen (editing code, quoting a passage,
filling a record from a document), the tokens that followed the last earlier occurrence of its
latest n tokens are a good guess for what comes next. `NgramProposer` proposes them as a draft
that `drafts.DraftVerifier` checks in the next forward; every emitted token is still the model's
own sample, so outputs follow token-by-token decoding exactly (see drafts.py).

Two sources, tried in this order:
1. the radix cache: when another request's cached sequence starts with this request's whole
   sequence so far (the same prompt asked again, another sample of it, an agent re-running a
   step), the cached tokens that follow are the draft (`cached_continuation`): the longest
   context there is to match, read from the tree without touching its LRU clock or counters;
2. the request's own prompt and output, by n-gram suffix match.

Per request the proposer keeps an index from each n-gram (n between the min and max match
windows) to where its latest occurrence ended, built incrementally as tokens are added, so a
proposal costs a few dictionary lookups however long the request is. The draft length adapts
to the request's acceptance: it grows while whole drafts are accepted, shrinks to just past
what was accepted, and speculation pauses for a request whose drafts are mostly rejected.

Edits: a request copying a text with changes (renaming a variable, filling a template) writes
its own token where the source had another, and the suffix it then ends with (the new name)
occurs nowhere earlier, so no n-gram matches until the copy has run on for a while. The
proposer therefore follows its source: after a draft is rejected it keeps the position in the
text just past the token the model wrote in place of the first unaccepted one (a substitution
of one token), and when no match of `STRONG_MATCH` tokens or more exists, it drafts what
follows that position before trying shorter matches (which often point at the wrong one of
several similar lines). Its first draft is `POINTER_DRAFT_TOKENS` long, each next one about
twice the last while they are accepted whole (`VerifyRows.grown`: a copy running on between
edits). A pointer whose own draft is rejected at its first token is dropped. After an n-gram
draft accepted whole the model's own next token decides: the source's token means the copy
goes on, which the lookup follows; another token is an edit just past the copied run (or the
copy's end, which the pointer's first short draft finds at the cost of a row or two), so the
pointer is set past it.

Renames: an edit that renames something writes the same new token for every occurrence of the
old one. When the model writes its own token where a draft copied another (or where the source
went on just past a draft accepted whole), and its next token is the one that followed in the
source (the copy goes on past a replacement), the replacement is the request's substitution
(`NgramState.substitutions`): later drafts copied from its own text carry it, and suffixes are
also looked up with the new tokens read as the old ones, so a copy of a renamed passage matches
its source; a draft whose substituted token the model does not write drops it. An insertion or
the end of a copy (the source's next token does not follow) teaches nothing.

Those are five kinds of draft (`DRAFT_KINDS`), accepted at very different rates by the text:
free writing repeats short runs that are not copies, an edit's pointer guesses wrong in prose,
and a rejoin wherever copied values end and the model's own text goes on (a record). Each kind
is proposed to a request only while its recent tokens' accepted share (`KindAcceptance`, over
all requests, with the request's own: `ngram_evidence.OwnDrafts`, its unverified drafts checked
too) is above the share a long draft needs to pay (the scheduler's measured `least`
break-even. A draft a request does not verify is checked against the tokens the model then
writes, and counts toward its kind's share as a verification would (`KindAcceptance.checked`):
a kind that stopped paying learns that it pays again without verifying rows to find out (no
probes). A match's draft reaches only as far as the copy it continues has run says its tokens
pay (`ngram_evidence.run_cap`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglite.runtime.cache.continuation import cached_continuation
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.multimodal.processor import is_pad
from sglite.runtime.scheduler.draft_tally import DraftTally, KindAcceptance
from sglite.runtime.scheduler.drafts import MAX_DRAFT_TOKENS
from sglite.runtime.scheduler.ngram_evidence import (
    OwnDrafts,
    UnverifiedDraft,
    copied_run,
    run_cap,
    run_needed,
)
from sglite.runtime.scheduler.ngram_index import SuffixIndex
from sglite.runtime.scheduler.ngram_renames import (
    Replacement,
    confirm_replacement,
    note_replacement,
)
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.speculation import (
    LOW_ACCEPTANCE,
    NGRAM_SOURCE,
    UNGROUPED_ROWS,
    BreakEvens,
    DraftLength,
    Proposal,
    SourceFilter,
    TokenHistory,
    VerifyRows,
    draft_room,
    proposals_from,
)

# A draft from the radix cache continues the request's whole context, not just its last few
# tokens, so it is accepted more often: it may be this many times the request's draft length.
CACHE_DRAFT_SCALE = 4
# A suffix match at least this long (or the longest window, if shorter) is drafted from before
# the source pointer; shorter ones only where there is no pointer.
STRONG_MATCH = 4
# Where a draft comes from: the radix cache, a suffix match of STRONG_MATCH tokens or more, the
# source pointer (past a rejected draft's replaced token, or "rejoin": past the model's own
# token just after a match accepted whole), a shorter match. How often each is accepted depends
# on the text (a copy, an edit, a record whose copied values end where the model's own text
# begins, free writing), so each kind is drafted only while its tokens' accepted share pays
# (`KindAcceptance`).
DRAFT_KINDS = ("cache", "strong", "pointer", "rejoin", "weak")
# A draft from the source pointer is a guess about an edit's extent: it starts short, so that a
# wrong one costs a verification of a few rows (about a plain step) rather than of a long draft,
# and grows (`VerifyRows.grown`) while the copy runs on.
POINTER_DRAFT_TOKENS = 2


@dataclass
class NgramState:
    """One request's n-gram index, tokens and draft length."""

    length: DraftLength
    index: SuffixIndex
    history: TokenHistory = field(default_factory=TokenHistory)
    draft_start: int | None = None  # where the last draft was copied from (None: the cache)
    from_pointer: bool = False  # whether the last draft was the pointer's
    pointer: int | None = None  # the source position the copy continues at (module docstring)
    proposed_at: int = 0  # the request's length when the last draft was proposed
    pointer_for: int = -1  # the request's length the pointer was set for (else it is stale)
    pointer_length: int = POINTER_DRAFT_TOKENS  # the pointer's next draft length
    # Whether the pointer stands only if the token before it was replaced (set after a match
    # accepted whole: the model's next token decides, `_stale_pointer`)
    pointer_if_replaced: bool = False
    kind: str = ""  # where the last draft came from (a DRAFT_KINDS name)
    share: float | None = None  # its kind's likely kept share here (None: a cost probe)
    own: OwnDrafts = field(default_factory=OwnDrafts)  # the request's own evidence, by kind
    # The request's replacements (a source token -> the token the model writes for it; their
    # inverse, for lookups), the last draft as copied (before them), and the replacements
    # awaiting the token after them.
    substitutions: dict[int, int] = field(default_factory=dict)
    originals: dict[int, int] = field(default_factory=dict)
    copied: list[int] = field(default_factory=list)
    pending: list[Replacement] = field(default_factory=list)

    def substitute(self, source: int, written: int) -> None:
        """Copies of `source` are written as `written` from now on."""
        self.forget_substitution(source)
        self.substitutions[source] = written
        self.originals[written] = source

    def forget_substitution(self, source: int) -> None:
        """Copies of `source` are copied as they are again."""
        written = self.substitutions.pop(source, None)
        if written is not None and self.originals.get(written) == source:
            del self.originals[written]


class NgramProposer:
    """Drafts from the request's prompt and output (a `speculation.Speculator`)."""

    def __init__(
        self,
        context_len: int,
        num_draft_tokens: int,
        min_match: int,
        max_match: int,
        cache: RadixCache | None = None,
        rows: VerifyRows = UNGROUPED_ROWS,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"n-gram match windows must satisfy 1 <= {min_match} <= {max_match}")
        self.cache = cache  # None: drafts from the request's own text only
        self.context_len = context_len
        self.num_draft_tokens = num_draft_tokens
        self.min_match = min_match
        self.max_match = max_match
        self.rows = rows  # how drafts are sized for the target's verification
        self.states: dict[str, NgramState] = {}
        self.kinds = {kind: KindAcceptance() for kind in DRAFT_KINDS}
        self.needed = LOW_ACCEPTANCE  # a long draft's break-even in this step (`price`)
        self.steps = 0  # steps proposed for (`speculate` calls)
        self.probed_at = -1  # the step of the latest cost probe (`_cost_probe`)

    def propose(self, req: Req) -> list[int]:
        """Up to the request's draft length of tokens: what follows its whole sequence in the
        radix cache, else what followed the longest earlier match of its current suffix of
        `STRONG_MATCH` to `max_match` tokens, else what follows the source pointer (module
        docstring), else the longest shorter match down to `min_match`; the `DraftProposer`
        bound holds."""
        state = self.states.get(req.rid)
        if state is None:
            index = SuffixIndex(self.min_match, self.max_match)
            sizes = DraftLength(self.num_draft_tokens, self.rows)
            state = self.states[req.rid] = NgramState(sizes, index)
        length = state.length.next(draft_room(req, self.context_len))
        if length <= 0:
            return []
        tokens = state.history.sync(req)
        checked = state.own.check(tokens, self.needed)
        if checked is not None:
            self.kinds[checked.kind].checked(checked.drafted, checked.kept, self.needed)
            if checked.kept == checked.drafted:
                state.length.shown(checked.drafted)
        confirm_replacement(state, tokens)
        state.draft_start, state.from_pointer, state.proposed_at = None, False, len(tokens)
        if self._stale_pointer(state, tokens):
            state.pointer = None
        if self.cache is not None:
            room = min(draft_room(req, self.context_len), MAX_DRAFT_TOKENS)
            longest = self.rows.scaled(length, CACHE_DRAFT_SCALE)
            cached = _tokens_only(cached_continuation(self.cache, tokens, min(room, longest)))
            if cached:
                if self._pays(state, "cache", len(cached)):
                    return self._proposed(state, cached, tokens)
                state.own.refused(UnverifiedDraft("cache", cached, len(tokens)))
        state.index.update(tokens)
        strong = min(STRONG_MATCH, self.max_match)
        start = state.index.match(tokens, strong, self.max_match, state.originals)
        taken = 0 if start is None else self._admits(state, "strong", tokens, start, length)
        pointer = state.pointer
        if not taken and pointer is not None and pointer < len(tokens) - 1:
            kind = "rejoin" if state.pointer_if_replaced else "pointer"
            start = pointer
            taken = self._admits(state, kind, tokens, pointer, min(length, state.pointer_length))
            state.from_pointer = taken > 0
        if not taken:
            start = state.index.match(tokens, self.min_match, strong - 1, state.originals)
            taken = 0 if start is None else self._admits(state, "weak", tokens, start, length)
        if not taken or start is None:
            return []
        state.draft_start = start
        state.copied = _tokens_only(tokens[start : start + taken])
        draft = [state.substitutions.get(t, t) for t in state.copied]
        return self._proposed(state, draft, tokens)

    def _admits(
        self, state: NgramState, kind: str, tokens: list[int], start: int, length: int
    ) -> int:
        """How many tokens of a draft of `kind` copied from `start` (up to `length`) may be
        proposed now (`_pays`; 0: none): as far as the copy it continues has run says they
        pay (`run_cap` at a long draft's break-even). A pointer past an edit continues the
        copy that ran up to the replaced token."""
        edited = kind in ("pointer", "rejoin")  # the last token written replaced start - 1's
        written, source = (tokens[:-1], start - 1) if edited else (tokens, start)
        run = copied_run(written, source, state.substitutions, run_needed(length, self.needed))
        cap = run_cap(run, self.needed, length)
        taken = self._pays(state, kind, cap)
        if not taken and state.own.unverified is None:  # checked as evidence instead
            draft = self._copy(state, tokens, start, max(cap, 1))
            state.own.refused(UnverifiedDraft(kind, draft, len(tokens)))
        return taken

    @staticmethod
    def _copy(state: NgramState, tokens: list[int], start: int, length: int) -> list[int]:
        """The draft copied from `start`: up to `length` tokens, the request's substitutions
        made."""
        return [state.substitutions.get(t, t) for t in _tokens_only(tokens[start : start + length])]

    @staticmethod
    def _proposed(state: NgramState, draft: list[int], tokens: list[int]) -> list[int]:
        """`draft`, noted as the request's latest proposal (checked as unverified evidence
        where no verification records it)."""
        state.own.proposed = UnverifiedDraft(state.kind, draft, len(tokens))
        return draft

    def speculate(self, reqs: list[Req], allowed: SourceFilter) -> dict[str, Proposal]:
        """`propose`'s drafts as the NGRAM_SOURCE's, each with its kind's accepted share."""
        return proposals_from(
            NGRAM_SOURCE, self._propose_each, reqs, allowed, lambda rid: self.states[rid].share
        )

    def gain(self, proposal: Proposal) -> float:
        """The tokens `proposal` likely saves beyond what it costs: its length times how far
        its kind's likely kept share is above a long draft's break-even (none for a cost probe)."""
        share = 0.0 if proposal.share is None else proposal.share
        return (share - self.needed) * len(proposal.tokens)

    def _propose_each(self, reqs: list[Req]) -> dict[str, list[int]]:
        self.steps += 1
        return {req.rid: self.propose(req) for req in reqs}

    def price(self, prices: Callable[[str], BreakEvens]) -> None:
        """Judge this step's drafts by its batch size's long-draft break-even."""
        self.needed = max(prices(NGRAM_SOURCE).least, LOW_ACCEPTANCE)

    def record(self, req: Req, drafted: int, accepted: int, shares: BreakEvens) -> None:
        """Adapt the request's draft length to a verification's result and move the source
        pointer past the model's own token: set after a rejected draft, kept while its own
        drafts are accepted, dropped after an n-gram draft accepted whole or when its own
        draft fails at once."""
        state = self.states.get(req.rid)
        if state is None:
            return
        state.length.record(drafted, accepted, shares)
        if state.kind in self.kinds:
            self.kinds[state.kind].record(drafted, accepted, shares.needed)
            state.own.verified(state.kind, drafted, accepted, shares.needed)
        # a kind is judged by what its longest drafts need: its short ones are the draft
        # length's to stop (DraftLength)
        self.needed = max(shares.least, LOW_ACCEPTANCE)
        note_replacement(state, drafted, accepted)
        whole = accepted == drafted
        if state.from_pointer:  # a copy past an edit that goes on is drafted further each time
            longer = self.rows.grown(state.pointer_length, self.num_draft_tokens)
            state.pointer_length = longer if whole else POINTER_DRAFT_TOKENS
        failed = state.from_pointer and accepted == 0
        if state.draft_start is None or failed:
            state.pointer = None
        else:
            state.pointer = state.draft_start + accepted + 1
            state.pointer_for = state.proposed_at + accepted + 1
            # A copy matched whole that goes on is followed by the n-gram lookup; the pointer
            # stays only if the model's next token replaced the source's (an edit just past it).
            state.pointer_if_replaced = whole and not state.from_pointer
            if not state.from_pointer:  # a new pointer: its first draft is short
                state.pointer_length = POINTER_DRAFT_TOKENS

    def shown(self, req: Req, tokens: int) -> None:
        """The target wrote this proposer's draft of `tokens` tokens for `req`, which another
        source's draft was verified in place of: its draft length grows as if it had been
        kept whole (`DraftLength.shown`)."""
        state = self.states.get(req.rid)
        if state is not None:
            state.length.shown(tokens)

    @staticmethod
    def _stale_pointer(state: NgramState, tokens: list[int]) -> bool:
        """Whether the source pointer no longer applies: tokens were written without a draft
        since it was set, or it was set past a match accepted whole and the model's next token
        is the source's own."""
        if state.pointer is None or state.pointer_for != len(tokens):
            return True
        return state.pointer_if_replaced and tokens[-1] == tokens[state.pointer - 1]

    def read_prompt(self, req: Req) -> None:
        """Nothing: a lookup indexes the prompt at its first proposal."""

    def forget(self, live: set[str]) -> None:
        """Drop the state of requests not in `live` (finished or aborted ones)."""
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]

    def flush(self) -> None:
        """Nothing is shared across requests: each index lives as long as its request."""

    def take_prompt_seconds(self) -> float:
        """None: a lookup reads no prompt ahead of time."""
        return 0.0

    def check_invariants(self) -> None:
        """The proposer holds no KV slots."""

    def info(self) -> dict[str, Any]:
        """The algorithm and its settings, for get_server_info."""
        return {
            "speculative_algorithm": "ngram",
            "speculative_ngram_match_window": [self.min_match, self.max_match],
            "speculative_ngram_from_radix_cache": self.cache is not None,
            "speculative_verify_row_group": self.rows.group,
            "speculative_ngram_drafts": {kind: tally.info() for kind, tally in self.kinds.items()},
        }

    def _pays(self, state: NgramState, kind: str, cap: int) -> int:
        """How many tokens of a draft of `kind` may be proposed now: `cap` where the kind's
        drafts pay on this request (`KindAcceptance.pays_for`: its own evidence with the
        kind's record), else none (the caller checks the draft as unverified evidence
        instead, which is how a kind that does not pay learns that it does again: no probe
        verifies rows for it). A draft proposed makes `kind` the request's draft kind."""
        if self.needed >= 1.0:
            return self._cost_probe(state, kind)
        tally = self.kinds[kind]
        own = state.own.tallies.get(kind)
        if cap <= 0 or not tally.pays_for(own, self.needed):
            return 0
        state.kind, state.share = kind, tally.expected_share_for(own or DraftTally())
        return cap

    def _cost_probe(self, state: NgramState, kind: str) -> int:
        """One token for the first request asked in this step, none for the others, where the
        latest verification found that no draft can pay (`needed` of 1 or more): the
        scheduler asks for drafts then only on the steps that measure the costs again
        (`SpeculationCosts.pays`), and one row measures them."""
        if self.probed_at == self.steps:
            return 0
        self.probed_at = self.steps
        state.kind, state.share = kind, None
        return 1


def _tokens_only(draft: list[int]) -> list[int]:
    """`draft` up to its first image position (negative pad ids are not tokens to propose)."""
    for i, token in enumerate(draft):
        if is_pad(token):
            return draft[:i]
    return draft
