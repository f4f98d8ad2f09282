"""N-gram speculative decoding (`--speculative-algorithm ngram`): drafts copied from the
radix cache (what followed the same sequence before) or the request's own text, verified by the
model in the next forward. Outputs are those of decoding
without it (greedy: identical; seeded sampling: the same draws); copy-heavy text takes fewer
forward passes."""

from __future__ import annotations

import collections
import json
from types import SimpleNamespace

import pytest
import requests
import torch

from sglite.runtime.cache.continuation import cached_continuation
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.scheduler.draft_tally import (
    KIND_PROBE_EVERY,
    KIND_PROBE_MAX,
    REQUEST_PRIOR_TOKENS,
    DraftTally,
    KindAcceptance,
)
from sglite.runtime.scheduler.ngram import POINTER_DRAFT_TOKENS, NgramProposer
from sglite.runtime.scheduler.ngram_evidence import (
    CheckedDraft,
    OwnDrafts,
    UnverifiedDraft,
    copied_run,
    run_cap,
    run_needed,
)
from sglite.runtime.scheduler.speculation import (
    EVERY_REQUEST,
    FIRST_DRAFT_TOKENS,
    LOW_ACCEPTANCE,
    MAX_BACKOFF,
    PAUSE_STEPS,
    UNGROUPED_ROWS,
    BreakEvens,
    DraftLength,
    Proposal,
    VerifyRows,
    proposals_from,
)
from sglite.runtime.scheduler.speculation_costs import (
    HOPELESS_PROBE_FIRST,
    HOPELESS_PROBE_MAX,
    PLAIN_PROBE_EVERY,
    PLAIN_WARMUP_STEPS,
    DraftCostFit,
    SpeculationCosts,
)

# Drafts sized for verification rows in groups of four (3, 7, 15 tokens: AVX2 builds), the
# sizes the n-gram tests that spell out their drafts were written for.
GROUPS_OF_FOUR = VerifyRows(4)

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PASSAGE = (
    "The old lighthouse stood on the northern cliff for two hundred years. Every night its "
    "keeper climbed the ninety steps, trimmed the wick and wound the clockwork that turned the "
    "great lens, so that ships passing the reef would see the beam and steer clear of the rocks."
)
CODE = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
COPY_PROMPTS = [
    CHAT.format(f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"),
    CHAT.format(f"Rename the function `area` to `rectangle_area` in this code:\n\n{CODE}"),
    CHAT.format(f"Quote the first sentence of this text:\n\n{PASSAGE}"),
]
FREE_PROMPTS = [
    CHAT.format("Tell me a short story about a fox."),
    CHAT.format("What is the capital of Italy?"),
]
GREEDY = {"temperature": 0, "max_new_tokens": 48}


# --------------------------------------------------------------------------- the proposer
def _req(tokens: list[int], rid: str = "r", remaining: int = 100) -> SimpleNamespace:
    """What the proposer reads of a request."""
    return SimpleNamespace(
        rid=rid,
        prompt_ids=tokens,
        output_ids=[],
        num_fill=len(tokens),
        remaining_new_tokens=remaining,
    )


def test_proposes_what_followed_the_longest_earlier_match():
    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=4, min_match=1, max_match=3, rows=GROUPS_OF_FOUR
    )
    # "7 8" occurs at 1-2 (then 9 10 11) and, longer, "6 7 8" at 4-6 (then 20 21 22 23).
    tokens = [5, 7, 8, 9, 10, 6, 7, 8, 20, 21, 22, 23, 24, 6, 7, 8]
    assert proposer.propose(_req(tokens)) == [20, 21, 22]  # a first draft: 3 tokens
    # Only a one-token match (the latest 8 is at position 7).
    assert proposer.propose(_req([1, 8, 2, 3, 4, 5, 8], rid="s")) == [2, 3, 4]
    assert proposer.propose(_req([1, 2, 3], rid="t")) == []  # nothing repeats


def test_after_an_edit_the_draft_follows_the_source_past_the_replaced_token():
    """Copying with a change (10 written as 20): the suffix ending in 20 occurs nowhere, but
    the copy goes on after the replaced token, so that is the next draft; a pointer whose own
    draft fails at once, or that tokens written without a draft made stale, is dropped."""
    prompt = [100, 1, 2, 3, 10, 4, 5, 6, 7, 8, 101]

    def at(output: list[int], rid: str = "r") -> SimpleNamespace:
        req = _req(prompt, rid)
        req.output_ids, req.num_fill = output, len(prompt) + len(output)
        return req

    def edited_once(proposer: NgramProposer, rid: str = "r") -> None:
        assert proposer.propose(at([1, 2], rid)) == [3, 10, 4]
        proposer.record(at([1, 2], rid), drafted=3, accepted=1, shares=BreakEvens.uniform())

    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    edited_once(proposer)
    edited = [1, 2, 3, 20]  # the model's own token replaced 10
    assert POINTER_DRAFT_TOKENS == 2
    assert proposer.propose(at(edited)) == [4, 5]  # just past what was accepted: 2 tokens
    assert proposer.states["r"].kind == "pointer"
    proposer.record(at(edited), drafted=2, accepted=2, shares=BreakEvens.uniform())
    # The copy went on past 20: a rename, so the suffix ending 20 4 5 6 matches the source's
    # 10 4 5 6, and the copy goes on as a match of STRONG_MATCH tokens.
    draft = proposer.propose(at(edited + [4, 5, 6]))
    assert draft == [7, 8, 101, 1, 2] and proposer.states["r"].kind == "strong"  # grown: 2 -> 5
    proposer.record(at(edited + [4, 5, 6]), len(draft), 3, BreakEvens.uniform())
    # (the model wrote its own token after 101; its length the request's: just past the 3
    # tokens the last draft kept)
    assert proposer.propose(at(edited + [4, 5, 6, 7, 8, 101])) == [1, 2, 3, 20]
    assert proposer.propose(at(edited, rid="fresh")) == []  # no pointer: nothing matches
    # Its own draft rejected at once: the pointer goes.
    dropped = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    edited_once(dropped)
    assert dropped.propose(at(edited)) == [4, 5]
    dropped.record(at(edited), drafted=2, accepted=0, shares=BreakEvens.uniform())
    assert dropped.propose(at(edited + [30])) == []
    # Stale: a token was written after the verification without a draft.
    stale = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    edited_once(stale)
    assert stale.propose(at(edited + [30])) == []


def test_a_rename_that_the_copy_goes_on_past_is_carried_into_later_drafts():
    """The model writes 20 where the source has 10, then the source's next token: a rename, so
    later drafts copied from the source carry 20 (and suffixes ending in 20 match the source's
    10); an insertion (the source's next token does not follow) teaches nothing, and a rename
    the model stops writing is dropped."""
    prompt = [100, 1, 10, 2, 3, 10, 4, 5, 10, 6, 101]

    def at(output: list[int], rid: str = "r") -> SimpleNamespace:
        req = _req(prompt, rid)
        req.output_ids, req.num_fill = output, len(prompt) + len(output)
        return req

    def verify(proposer: NgramProposer, output: list[int], accepted: int, rid: str) -> list:
        draft = proposer.propose(at(output, rid))
        proposer.record(at(output, rid), len(draft), accepted, BreakEvens.uniform())
        return draft

    def renamed_once(proposer: NgramProposer, rid: str) -> None:
        assert verify(proposer, [100, 1], 0, rid) == [10, 2, 3]  # the model wrote 20
        assert verify(proposer, [100, 1, 20], 1, rid) == [2]  # and went on with the source

    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    renamed_once(proposer, "r")
    # the suffix 1 20 2 3 is found as the source's 1 10 2 3, and what follows carries 20
    assert verify(proposer, [100, 1, 20, 2, 3], 2, "r") == [20, 4, 5]  # grown: 1 -> 3
    assert proposer.states["r"].substitutions == {10: 20}

    inserted = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    assert verify(inserted, [100, 1], 0, "i") == [10, 2, 3]  # 20 written ...
    assert verify(inserted, [100, 1, 20], 0, "i") == [2]  # ... then 30, not the source's 2
    inserted.propose(at([100, 1, 20, 30], "i"))
    assert inserted.states["i"].substitutions == {}

    refused = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    renamed_once(refused, "x")
    assert verify(refused, [100, 1, 20, 2, 3], 0, "x") == [20, 4, 5]  # 20 refused for 10 ...
    assert refused.states["x"].substitutions == {}  # ... so it is dropped


def test_an_edit_just_past_a_match_accepted_whole_is_followed_and_learned():
    """A copied draft accepted whole, then the model's own token where the source has 10 (a
    rename right after the copied run): no suffix ending in it matches, so the draft follows
    the source past it, and the copy going on makes it a substitution. Where the model writes
    the source's own token the copy goes on by the lookup; where the copy ended (the pointer's
    draft fails at once) nothing is learned and the pointer goes."""
    prompt = [100, 1, 2, 3, 4, 5, 10, 7, 8, 9, 101]

    def at(output: list[int], rid: str = "r") -> SimpleNamespace:
        req = _req(prompt, rid)
        req.output_ids, req.num_fill = output, len(prompt) + len(output)
        return req

    def copied_whole(proposer: NgramProposer, rid: str) -> None:
        assert proposer.propose(at([1, 2], rid)) == [3, 4, 5]
        proposer.record(at([1, 2], rid), drafted=3, accepted=3, shares=BreakEvens.uniform())

    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    copied_whole(proposer, "r")
    renamed = [1, 2, 3, 4, 5, 20]  # the model's own token after the draft replaced 10
    assert proposer.propose(at(renamed)) == [7, 8]
    assert proposer.states["r"].kind == "rejoin"  # a kind of its own: its share is its own
    proposer.record(at(renamed), drafted=2, accepted=2, shares=BreakEvens.uniform())
    proposer.propose(at(renamed + [7, 8, 9]))
    assert proposer.states["r"].substitutions == {10: 20}

    goes_on = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    copied_whole(goes_on, "g")
    assert goes_on.propose(at([1, 2, 3, 4, 5, 10], "g"))[:4] == [7, 8, 9, 101]
    assert goes_on.states["g"].kind == "strong"

    ended = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )
    copied_whole(ended, "e")
    assert ended.propose(at([1, 2, 3, 4, 5, 30], "e")) == [7, 8]
    ended.record(at([1, 2, 3, 4, 5, 30], "e"), drafted=2, accepted=0, shares=BreakEvens.uniform())
    assert ended.propose(at([1, 2, 3, 4, 5, 30, 31], "e")) == []
    assert ended.states["e"].substitutions == {}


def test_a_new_pointers_first_draft_is_short_after_an_earlier_one_grew():
    """A pointer's drafts grow while accepted whole; a later pointer (here a rejoin after a
    match accepted whole) starts again at POINTER_DRAFT_TOKENS, so a wrong guess costs few rows."""
    prompt = [100, 1, 2, 3, 10, 4, 5, 6, 7, 8, 101]

    def at(output: list[int]) -> SimpleNamespace:
        req = _req(prompt)
        req.output_ids, req.num_fill = output, len(prompt) + len(output)
        return req

    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=2, max_match=4, rows=GROUPS_OF_FOUR
    )

    def verified(output: list[int], accepted: int) -> None:
        draft = proposer.propose(at(output))
        proposer.record(at(output), len(draft), accepted, BreakEvens.uniform())

    verified([1, 2], 1)  # 10 replaced by 20: a pointer past it
    verified([1, 2, 3, 20], 2)  # its draft 4 5 accepted whole: the next would be longer
    assert proposer.states["r"].pointer_length == GROUPS_OF_FOUR.grown(POINTER_DRAFT_TOKENS, 8)
    verified([1, 2, 3, 20, 4, 5, 6], 5)  # a strong match, 7 8 101 1 2, accepted whole
    # the model wrote 30 where the source has 3
    rejoined = [1, 2, 3, 20, 4, 5, 6, 7, 8, 101, 1, 2, 30]
    assert proposer.propose(at(rejoined)) == [20, 4]  # POINTER_DRAFT_TOKENS long again
    assert proposer.states["r"].kind == "rejoin"


def test_the_radix_cache_drafts_what_followed_the_whole_sequence():
    pool = KVPool(64, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool)
    for ids in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 8]):
        cache.insert(ids, pool.alloc(len(ids)))
    cache.match_prefix([1, 2, 3, 9])  # the newer branch under [1, 2, 3]
    snapshot = [(n.key, n.last_access, n.hit_count) for n in cache._iter_nodes()]
    assert cached_continuation(cache, [1, 2], 8) == [3, 9, 9]  # inside an edge, then a branch
    assert cached_continuation(cache, [1, 2, 3, 4], 8) == [5, 6]
    assert cached_continuation(cache, [1, 2, 3, 4], 1) == [5]
    assert cached_continuation(cache, [1, 2, 4], 8) == []  # not a cached prefix
    assert cached_continuation(cache, [1, 2, 3, 4, 5, 6], 8) == []  # nothing follows
    assert snapshot == [(n.key, n.last_access, n.hit_count) for n in cache._iter_nodes()]
    # The proposer prefers the cache (the whole context matched) to its own n-grams, and falls
    # back to them where the cache has nothing.
    proposer = NgramProposer(1000, 4, 1, 3, cache)
    assert proposer.propose(_req([1, 2, 3, 4])) == [5, 6]
    assert proposer.propose(_req([7, 1, 7], rid="s")) == [1, 7]
    cache.check_invariants()


def test_drafts_fit_the_requests_budget_and_context():
    proposer = NgramProposer(context_len=1000, num_draft_tokens=8, min_match=2, max_match=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert proposer.propose(_req(tokens, remaining=4)) == [3, 4, 5]  # 3 + the model's own token
    assert proposer.propose(_req(tokens, rid="b", remaining=1)) == []
    tight = NgramProposer(context_len=len(tokens) + 2, num_draft_tokens=8, min_match=2, max_match=4)
    assert tight.propose(_req(tokens)) == [3]


def test_draft_length_follows_acceptance_and_speculation_pauses_when_it_does_not_pay():
    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=1, max_match=2, rows=GROUPS_OF_FOUR
    )
    tokens = list(range(20)) * 3
    req = _req(tokens)
    assert len(proposer.propose(req)) == GROUPS_OF_FOUR.first(8) == 3  # a first draft starts short
    proposer.record(req, drafted=3, accepted=3, shares=BreakEvens.uniform())
    assert len(proposer.propose(req)) == 7  # and grows while whole drafts are accepted: 4 -> 8 rows
    proposer.record(req, drafted=7, accepted=2, shares=BreakEvens.uniform())
    assert len(proposer.propose(req)) == 3  # just past what was accepted
    proposer.record(req, drafted=3, accepted=3, shares=BreakEvens.uniform())
    assert len(proposer.propose(req)) == 7  # grows again
    proposer.record(
        req, drafted=7, accepted=0, shares=BreakEvens.uniform()
    )  # closes a window: 8 of 20 accepted, fine
    assert len(proposer.propose(req)) == 1
    proposer.record(req, drafted=8, accepted=0, shares=BreakEvens.uniform())
    proposer.record(
        req, drafted=8, accepted=0, shares=BreakEvens.uniform()
    )  # none of 16 accepted: speculation pauses
    assert [proposer.propose(req) for _ in range(PAUSE_STEPS)] == [[]] * PAUSE_STEPS
    assert len(proposer.propose(req)) == GROUPS_OF_FOUR.first(8)  # back, short again
    proposer.forget(set())
    assert proposer.states == {}


def test_a_short_draft_kept_whole_grows_from_its_own_length():
    """An edit's copies: after a long draft, a 2-token draft (a short match, a pointer's first)
    kept whole earns a draft of 5 (6 rows), not twice the long one: its kept tokens say little
    of a long run, and a 15-token draft rejected early costs 16 rows."""
    length = DraftLength(15, GROUPS_OF_FOUR)
    for drafted in (3, 7):
        length.record(drafted, drafted, BreakEvens.uniform())
    assert length.next(room=100) == 15
    length.record(2, 2, BreakEvens.uniform())
    assert length.next(room=100) == GROUPS_OF_FOUR.grown(2, 15) == 5
    length.record(5, 5, BreakEvens.uniform())
    assert length.next(room=100) == 11 and length.next(room=4) == 4


def test_drafts_fill_whole_groups_of_rows_where_the_kernels_take_rows_in_groups():
    """Where the target's GEMV takes x rows four at a time, a fifth row costs a group of its
    own, so a draft with the model's own token fills whole groups (3, 7, 15 tokens); where
    every row costs about alike, drafts double from 4 tokens. A cache draft CACHE_DRAFT_SCALE
    times as long stays whole groups."""

    def kept_whole(rows: VerifyRows) -> list[int]:
        length, seen = DraftLength(31, rows), []
        for _ in range(4):
            seen.append(length.next(room=100))
            length.record(seen[-1], seen[-1], BreakEvens.uniform())
        return seen

    assert kept_whole(GROUPS_OF_FOUR) == [3, 7, 15, 31]
    assert kept_whole(UNGROUPED_ROWS) == [4, 8, 16, 31]
    assert GROUPS_OF_FOUR.scaled(3, 4) == 15 and UNGROUPED_ROWS.scaled(4, 4) == 16
    assert GROUPS_OF_FOUR.first(2) == UNGROUPED_ROWS.first(2) == 2  # within the maximum
    tokens = [5, *range(20, 40), 6, 5]  # "5" recurs: a copy of 20 ... follows
    for rows, first in ((GROUPS_OF_FOUR, 3), (UNGROUPED_ROWS, 4)):
        proposer = NgramProposer(1000, 16, 1, 3, rows=rows)
        assert proposer.propose(_req(tokens)) == list(range(20, 20 + first))


def test_the_targets_kernels_decide_how_drafts_are_sized():
    """A model whose weights take the int8 GEMV for five rows and more (an AVX2 build: no GEMM
    takes them) gets drafts in whole groups of four rows, from the server's speculator on; one
    where a GEMM takes them, or whose activations are not rounded, gets ungrouped drafts."""
    from sglite.runtime.model.gguf_weight import KERNEL_OFF_ROWS, GGUFWeight
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.model.weight_policy import verification_row_group
    from sglite.runtime.scheduler.speculators import build_speculator
    from sglite.runtime.server_args import ServerArgs

    loaded = load_model("smollm2-135m", quantization="auto", progress=False)
    weights = [w for w in _weight_objects(loaded.model) if isinstance(w, GGUFWeight)]
    assert weights and all(w.round_activations for w in weights)

    def with_thresholds(gemm_from: int) -> int:
        for w in weights:
            w.a8_gemm_min_rows, w.amx_min_rows = gemm_from, KERNEL_OFF_ROWS
        return verification_row_group(loaded.model)

    assert with_thresholds(KERNEL_OFF_ROWS) == 4
    args = ServerArgs(model_path=loaded.model_path, speculative_algorithm="ngram")
    speculator = build_speculator(args, loaded, 1000, 1000, cache=None)
    assert speculator is not None and speculator.rows == GROUPS_OF_FOUR
    assert speculator.info()["speculative_verify_row_group"] == 4  # get_server_info's
    assert with_thresholds(4) == with_thresholds(5) == 1  # a GEMM from the fifth row at most
    assert with_thresholds(6) == 4
    for w in weights:
        w.round_activations = False
    assert with_thresholds(KERNEL_OFF_ROWS) == 1


def _weight_objects(model: torch.nn.Module) -> list[object]:
    """Every weight object the model's projections and output head hold (their attributes)."""
    held = [model.lm_head_quantized]
    for module in model.modules():
        held.extend(vars(module).values())
    return held


def test_a_draft_kind_that_does_not_pay_is_only_probed_until_it_does():
    """A probe gap counts steps with a proposal refused, not proposals: a batch's requests
    asked in one step count once (each probe adds rows to the whole batch's verification)."""
    tally = KindAcceptance()
    assert tally.admit(tally.pays(0.35), step=0)  # untried: drafted
    for _ in range(40):
        tally.record(drafted=2, accepted=0, needed=0.35)
    allowed = [tally.admit(tally.pays(0.35), step) for step in range(1, 7 * KIND_PROBE_EVERY + 1)]
    # probes after 8, then 16, then 32 refusals: each probe that fails doubles the gap
    probes = [i + 1 for i, ok in enumerate(allowed) if ok]
    assert probes == [KIND_PROBE_EVERY, 3 * KIND_PROBE_EVERY, 7 * KIND_PROBE_EVERY]
    batch = [tally.admit(False, step) for step in range(1000, 1000 + 4 * KIND_PROBE_EVERY)]
    asked_four_at_once = [tally.admit(False, 2000 + step // 4) for step in range(16 * 8 * 4)]
    assert sum(batch) == 0 and sum(asked_four_at_once) == 1  # the gap is 64 steps by then
    for _ in range(40):
        tally.record(drafted=2, accepted=2, needed=0.35)
    assert tally.admit(tally.pays(0.35), step=5000) and tally.probe_gap == KIND_PROBE_EVERY


def test_a_requests_own_drafts_outweigh_the_kinds_after_a_few():
    """The kind's recent drafts (all requests) are a request's prior worth REQUEST_PRIOR_TOKENS
    tokens: after long drafts that paid, a request whose own first drafts fail stops, one
    whose own drafts are kept goes on; after drafts that did not pay, the same holds the other
    way round."""
    paid = KindAcceptance()
    for _ in range(60):
        paid.record(drafted=8, accepted=8, needed=0.8)
    assert paid.covers_cost_for(DraftTally())  # nothing of its own yet: the kind's
    failing, kept = DraftTally(), DraftTally()
    for _ in range(3):  # 12 tokens of its own, each a quarter kept where 0.8 was needed
        failing.record(drafted=4, accepted=1, needed=0.8)
        kept.record(drafted=4, accepted=4, needed=0.8)
    assert failing.drafted > REQUEST_PRIOR_TOKENS
    assert not paid.covers_cost_for(failing) and paid.covers_cost_for(kept)
    assert paid.expected_share_for(failing) < 0.8 < paid.expected_share_for(kept)
    assert paid.expected_share_for(DraftTally()) == pytest.approx(paid.share)

    unpaid = KindAcceptance()
    for _ in range(60):
        unpaid.record(drafted=8, accepted=2, needed=0.8)
    assert not unpaid.covers_cost_for(DraftTally())
    assert not unpaid.covers_cost_for(kept)  # 12 tokens of its own: not yet
    for _ in range(5):
        kept.record(drafted=4, accepted=4, needed=0.8)
    assert unpaid.covers_cost_for(kept)


def test_a_copy_drafts_where_its_kind_does_not_pay_once_its_own_unverified_drafts_kept():
    """After other requests' long matches failed (their kind's record far below the share a
    draft needs), a request copying a passage is refused its drafts, but each refused draft is
    checked against what the model then writes: once its own copies are seen kept, it drafts
    (its share its own evidence with the kind's), as far as its copy's run says a token is
    likely kept; a request whose text leaves the passage stays refused."""
    proposer = NgramProposer(context_len=1000, num_draft_tokens=15, min_match=2, max_match=4)
    proposer.needed = 0.8  # as a batch of four had it on an AVX2 host
    for kind in proposer.kinds.values():
        for _ in range(60):
            kind.record(drafted=8, accepted=2, needed=0.8)
    passage = list(range(100, 160))
    prompt = passage + [1, 2]

    def written(output: list[int], rid: str) -> SimpleNamespace:
        req = _req(prompt, rid)
        req.output_ids, req.num_fill = output, len(prompt) + len(output)
        return req

    drafted_at = None
    for n in range(4, 40):  # the model copies the passage, one plain step a token
        draft = proposer.propose(written(passage[:n], "copy"))
        if draft:
            drafted_at = n
            break
    assert drafted_at is not None
    # as long as a copy that ran `drafted_at` tokens likely goes on at 0.8 a token (run_cap)
    assert draft == passage[drafted_at : drafted_at + (drafted_at + 1) // 4]
    own = proposer.states["copy"].own.tallies["strong"]
    assert own.accepted == own.drafted >= 20
    assert proposer.states["copy"].share > 0.8

    # copies four or five tokens at a time, then writes its own: its matches' drafts fail
    elsewhere = [t for i in range(0, 60, 10) for t in (*passage[i : i + 5], 300 + i)]
    assert not any(proposer.propose(written(elsewhere[:n], "other")) for n in range(4, 36))
    own = proposer.states["other"].own.tallies["strong"]
    assert own.drafted > 0 and not proposer.kinds["strong"].pays_for(own, 0.8)


def test_a_draft_reaches_as_far_as_its_copy_has_run_at_the_share_a_token_needs():
    """A copy that has run r tokens is drafted up to (r + 1)(1 - m) / m tokens at a break-even
    m: the first tokens of a fresh match at a low break-even, only long copies' where a token
    needs most of what it saves (a batch on a CPU), nothing where no token pays."""
    source = [1, 2, 3, 4, 5, 6, 7, 8]
    sequence = [9, *source, 0, 1, 2, 3]  # 1 2 3 copied again: the copy ran 3 tokens
    assert copied_run(sequence, 4, {}, longest=64) == 3  # a draft from source position 4
    assert copied_run(sequence, 4, {}, longest=2) == 2  # counted no further than asked
    assert copied_run(sequence, 6, {}, longest=64) == 0  # a draft from 6 would not continue it
    assert copied_run([*sequence[:-1], 30], 4, {3: 30}, longest=64) == 3  # a rename
    assert run_cap(run_needed(15, 0.75), 0.75, 15) == 15 > run_cap(42, 0.75, 15)
    assert run_cap(0, 0.25, 15) == 3 and run_cap(3, 0.25, 15) == 12 and run_cap(9, 0.25, 15) == 15
    assert run_cap(3, 0.8, 15) == 1 and run_cap(43, 0.75, 15) == 14 and run_cap(2, 0.8, 15) == 0
    assert run_cap(100, 1.0, 15) == 0


def test_where_no_draft_token_pays_one_request_a_step_drafts_one_token_to_price_them():
    """A long draft's break-even at 1 or more (the latest verification priced drafts out)
    caps every draft at nothing; the scheduler then asks for drafts only on the steps that
    price them again (`SpeculationCosts.pays`), and one token of one request's draft is
    verified on each: a probe, which no share judges."""
    proposer = NgramProposer(context_len=1000, num_draft_tokens=8, min_match=1, max_match=4)
    proposer.needed = 1.2
    strong = [10, 11, 12, 13, 14, 15, 10, 11, 12, 13]
    allow_all = lambda source: EVERY_REQUEST  # noqa: E731
    for step in range(2):
        reqs = [_req(strong, rid=f"r{step}{i}") for i in range(4)]
        proposals = proposer.speculate(reqs, allow_all)
        assert list(proposals) == [f"r{step}0"]
        assert proposals[f"r{step}0"] == Proposal([14], "ngram", share=None)
    proposer.record(reqs[0], drafted=1, accepted=1, shares=BreakEvens.uniform(0.35))
    assert proposer.needed == 0.35  # priced again: every request drafts
    reqs = [_req(strong, rid=f"s{i}") for i in range(4)]
    assert len(proposer.speculate(reqs, allow_all)) == 4


def test_unverified_drafts_count_once_the_model_has_written_their_tokens():
    """A proposal that no verification recorded, or a draft refused, is checked against the
    tokens written after it: undecided until they are, one at a time."""
    own = OwnDrafts()
    own.proposed = UnverifiedDraft("strong", [5, 6, 7], at=10)
    before = list(range(10))
    assert own.check(before + [5], needed=0.5) is None and own.tallies == {}  # undecided
    assert own.check(before + [5, 6, 9], needed=0.5) == CheckedDraft("strong", 3, 2)
    assert (own.tallies["strong"].accepted, own.tallies["strong"].drafted) == (2, 3)
    own.refused(UnverifiedDraft("weak", [1, 2], at=13))
    own.refused(UnverifiedDraft("strong", [4], at=13))  # one checked at a time: dropped
    assert own.check(before + [5, 6, 9, 1, 2], needed=0.5) == CheckedDraft("weak", 2, 2)
    assert own.tallies["weak"].accepted == 2 and own.tallies["strong"].drafted == 3
    own.proposed = UnverifiedDraft("strong", [8], at=15)
    own.verified("strong", drafted=1, accepted=0, needed=0.5)  # verified: not checked again
    assert own.proposed is None and own.check(before + [5, 6, 9, 1, 2, 8], needed=0.5) is None


def test_a_due_probe_waits_for_a_cheap_moment():
    tally = KindAcceptance()
    for _ in range(40):
        tally.record(drafted=2, accepted=0, needed=0.35)
    assert [tally.admit(False, step) for step in range(KIND_PROBE_EVERY - 1)] == [False] * (
        KIND_PROBE_EVERY - 1
    )
    due = KIND_PROBE_EVERY - 1
    assert [tally.admit(False, due + i, cheap=False) for i in range(3)] == [False] * 3
    assert tally.admit(False, due + 3, cheap=True)  # the deferred probe
    assert tally.probe_gap == 2 * KIND_PROBE_EVERY and tally.refused == 0


def test_short_matches_stop_being_drafted_when_they_fail_while_long_ones_go_on():
    """Free writing repeats short token runs that are not copies: drafts from them are
    rejected, and every verification of them costs rows that save no step."""
    proposer = NgramProposer(
        context_len=1000, num_draft_tokens=8, min_match=1, max_match=4, rows=GROUPS_OF_FOUR
    )
    weak = [5, 6, 7, 8, 9, 1, 2, 3, 1, 2]  # only a 2-token suffix recurs
    strong = [10, 11, 12, 13, 14, 15, 10, 11, 12, 13]  # a 4-token suffix recurs
    for i in range(40):  # a fresh request each time: its own draft length never pauses
        req = _req(weak, rid=f"w{i}")
        draft = proposer.propose(req)
        if draft:
            proposer.record(req, drafted=len(draft), accepted=0, shares=BreakEvens.uniform(0.35))
        req = _req(strong, rid=f"s{i}")
        draft = proposer.propose(req)
        assert draft == [14, 15, 10]  # a fresh request's first draft
        proposer.record(
            req, drafted=len(draft), accepted=len(draft), shares=BreakEvens.uniform(0.35)
        )
    assert not proposer.kinds["weak"].pays(proposer.needed)
    # never verified to find out whether they pay again (no probe): their rows cost a batch
    assert not any(proposer.propose(_req(weak, rid=f"x{i}")) for i in range(2 * KIND_PROBE_MAX))
    assert proposer.info()["speculative_ngram_drafts"]["strong"]["accepted"] == 40 * 3


def test_a_kind_that_stopped_paying_drafts_again_once_its_unverified_drafts_are_kept():
    """A kind's record learns from drafts no one verified: a request copying a passage is
    refused its drafts (its kind's record far below the share a draft needs), but each refused
    draft is checked against what the model then writes and counted in the kind's record as
    a verification would be, so that a new request, with no evidence of its own, is drafted
    for once the copies are seen kept: no rows were verified to find out."""
    proposer = NgramProposer(context_len=1000, num_draft_tokens=15, min_match=2, max_match=4)
    proposer.needed = 0.35
    for kind in proposer.kinds.values():
        for _ in range(60):
            kind.record(drafted=8, accepted=2, needed=0.35)
    passage = list(range(100, 200))
    prompt = [*passage, 1, 2]
    fresh = [*passage[:30], 3, *passage[:8]]  # a new request's strong match

    def written(output: list[int], rid: str) -> SimpleNamespace:
        req = _req(prompt, rid)
        req.output_ids, req.num_fill = output, len(prompt) + len(output)
        return req

    assert not proposer.propose(_req(fresh, "before"))
    drafted_fresh_at = None
    for n in range(4, 100):  # the model copies the passage, one plain step a token
        proposer.propose(written(passage[:n], "copy"))  # refused or left unverified: checked
        if proposer.propose(_req(fresh, f"fresh{n}")):
            drafted_fresh_at = n
            break
    assert drafted_fresh_at is not None
    strong = proposer.info()["speculative_ngram_drafts"]["strong"]
    assert strong["drafted"] == 60 * 8  # none verified since the failures
    assert strong["checked"] == strong["checked_kept"] > 0


def test_ngram_drafts_carry_their_kinds_share():
    proposer = NgramProposer(context_len=1000, num_draft_tokens=8, min_match=1, max_match=4)
    strong = [10, 11, 12, 13, 14, 15, 10, 11, 12, 13]
    allow_all = lambda source: EVERY_REQUEST  # noqa: E731
    (proposal,) = proposer.speculate([_req(strong, rid="a")], allow_all).values()
    assert proposal.share == 1.0  # too few drafts to tell: counted as likely kept whole
    for _ in range(10):
        proposer.kinds["strong"].record(drafted=4, accepted=3, needed=0.35)
    (proposal,) = proposer.speculate([_req(strong, rid="b")], allow_all).values()
    assert proposal.share == pytest.approx(proposer.kinds["strong"].share)
    assert 0.7 < proposal.share < 0.75
    for kind in proposer.kinds.values():  # every kind fails: none is drafted
        for _ in range(40):
            kind.record(drafted=4, accepted=0, needed=0.35)
    reqs = [_req(strong, rid=f"r{i}") for i in range(KIND_PROBE_EVERY)]
    assert proposer.speculate(reqs, allow_all) == {}


def test_weak_guesses_alone_in_a_batch_step_are_not_worth_its_verification():
    """At batch 4 a verification has a fixed cost of its own (28 ms against an 80 ms plain
    step): one-in-four guesses pay their own rows but not that, unless the step verifies
    anyway."""
    costs = SpeculationCosts()
    costs.observe(4, drafted=0, seconds=0.080, source="")
    for _ in range(20):
        for drafted in (2, 4, 8, 16):
            costs.observe(4, drafted, seconds=0.080 + 0.028 + 0.004 * drafted, source="ngram")
    weak = {f"w{i}": Proposal([1, 2], "ngram", share=0.26) for i in range(4)}
    assert costs.worth_verifying(4, weak, verifying=False) == {}
    assert costs.worth_verifying(4, weak, verifying=True) == weak  # a grammar's forced tokens
    with_model = {**weak, "m": Proposal([3, 4, 5], "draft")}  # its passes spent: verified
    costs.observe(4, drafted=3, seconds=0.080 + 0.028 + 3 * 0.010, source="draft")
    assert costs.worth_verifying(4, with_model, verifying=False) == with_model
    copies = {f"c{i}": Proposal(list(range(8)), "ngram", share=0.9) for i in range(4)}
    assert costs.worth_verifying(4, copies, verifying=False) == copies
    hopeless = {"h": Proposal([1, 2], "ngram", share=0.1), **copies}  # 2 ms saved, 4 ms a row
    assert costs.worth_verifying(4, hopeless, verifying=False) == copies
    probe = {"p": Proposal([1, 2], "ngram")}
    assert costs.worth_verifying(4, probe, verifying=False) == probe
    assert costs.worth_verifying(2, weak, verifying=False) == weak  # nothing measured at 2


def test_ngram_drafts_at_a_new_batch_size_are_priced_by_the_nearest_one_measured():
    """Verification rows cost about the same seconds whatever the batch's other rows, so the
    n-gram drafts' costs measured at batch 1 price them at batch 4 before any is measured
    there: against a quarter of a plain step of four saved per accepted token, a 16-token
    guess half likely kept is not worth verifying (unpriced, it ran and lost the step). A
    draft model's cost per token (its passes' share of it falls as the batch grows) prices a
    smaller batch only: from a larger one its drafts look no dearer than they are, where they
    cannot pay they cannot; from a smaller one they would look dearer, and go unmeasured."""
    costs = _ngram_costs_measured_at_batch_1(plain=0.043, per_token=0.015)
    costs.observe(1, drafted=4, seconds=0.043 + 4 * 0.035, source="draft")
    guess = {"g": Proposal(list(range(16)), "ngram", share=0.5)}
    assert costs.worth_verifying(1, guess, verifying=False) == guess  # 21.5 ms saved, 15 spent
    assert costs.worth_verifying(4, guess, verifying=False) == {}  # 9.75 ms saved
    assert costs.break_even(4, 16, "ngram") == pytest.approx(0.015 / (0.078 / 4))
    assert costs.coefficients(4, "draft") is None  # not from batch 1's 35 ms a token
    costs.observe(4, drafted=8, seconds=0.078 + 8 * 0.030, source="draft")
    costs.observe(2, drafted=0, seconds=0.052, source="")
    assert costs.coefficients(2, "draft") == costs.coefficients(4, "draft")
    assert costs.marginal(2, "draft") > 1.0  # 30 ms a drafted token at least, 26 ms saved
    costs.observe(4, drafted=8, seconds=0.078 + 8 * 0.004, source="ngram")  # measured at 4
    assert costs.break_even(4, 8, "ngram") == pytest.approx(0.004 / (0.078 / 4))


def _ngram_costs_measured_at_batch_1(plain: float, per_token: float) -> SpeculationCosts:
    """Costs with plain steps measured at batch 1 (`plain` seconds) and 4 (78 ms), and n-gram
    drafts of 2, 8 and 16 tokens at batch 1 only, each token `per_token` seconds more."""
    costs = SpeculationCosts()
    costs.observe(1, drafted=0, seconds=plain, source="")
    costs.observe(4, drafted=0, seconds=0.078, source="")
    for _ in range(20):
        for drafted in (2, 8, 16):
            costs.observe(1, drafted, seconds=plain + per_token * drafted, source="ngram")
    return costs


def test_a_step_judges_ngram_drafts_by_its_own_batch_sizes_costs():
    """A batch of four after a lone request: the proposer's break-even follows the step's batch
    size (`price`), not the latest verification's (a lone request's), so a kind kept 60% of
    the time, which pays where a row costs a third of what a token saves, is refused where it
    costs three quarters, before any draft is verified at batch 4, and taken again at 1."""
    costs = _ngram_costs_measured_at_batch_1(plain=0.042, per_token=0.014)
    proposer = NgramProposer(context_len=1000, num_draft_tokens=8, min_match=1, max_match=4)
    for _ in range(60):
        proposer.kinds["strong"].record(drafted=5, accepted=3, needed=0.33)
    strong = [10, 11, 12, 13, 14, 15, 10, 11, 12, 13]
    proposer.price(lambda source: costs.break_evens(1, 1, source))
    assert proposer.needed == pytest.approx(0.014 / 0.042)
    assert proposer.propose(_req(strong, rid="alone"))
    proposer.price(lambda source: costs.break_evens(4, 1, source))
    assert proposer.needed == pytest.approx(0.014 / (0.078 / 4))
    assert not any(proposer.propose(_req(strong, rid=f"b{i}")) for i in range(4))
    proposer.price(lambda source: costs.break_evens(1, 1, source))
    assert proposer.propose(_req(strong, rid="alone again"))


def test_ngram_drafts_measured_nowhere_are_measured_on_one_requests_draft():
    """A fresh server's first n-gram drafts at a batch of four cost rows that may not pay at
    any acceptance: until their cost per token is measured at some batch size, one request
    of the step drafts (the first that has a match), its draft verified without the other
    source's (a step mixing sources measures neither); measured, every request; where they
    cannot pay, none. A draft model drafts for every request when unpriced (its passes serve
    the batch at once: one request's draft would measure a whole pass per token), its drafts
    kept over the n-gram ones (their passes are spent)."""
    costs = SpeculationCosts()
    for _ in range(PLAIN_WARMUP_STEPS):
        assert not costs.allows_drafts(4)
        costs.observe(4, drafted=0, seconds=0.078, source="")
    assert costs.allows_drafts(4)
    assert costs.drafting_requests(4, "ngram") == 1
    assert costs.drafting_requests(4, "draft") == EVERY_REQUEST
    reqs = [SimpleNamespace(rid=f"r{i}") for i in range(4)]
    asked: list[list[str]] = []

    def propose_many(batch: list[SimpleNamespace]) -> dict[str, list[int]]:
        asked.append([req.rid for req in batch])
        return {req.rid: [] if req.rid == "r0" else [7, 8, 9] for req in batch}  # r0: no match

    one = proposals_from("ngram", propose_many, reqs, lambda source: 1)
    assert asked == [["r0"], ["r1"]] and list(one) == ["r1"]
    every = proposals_from("draft", propose_many, reqs, lambda source: EVERY_REQUEST)
    assert asked[-1] == ["r0", "r1", "r2", "r3"] and list(every) == ["r1", "r2", "r3"]
    mixed = {"r1": Proposal([5, 6], "ngram", share=1.0), "r2": every["r2"], "r3": every["r3"]}
    assert costs.worth_verifying(4, mixed, verifying=False) == {k: every[k] for k in ("r2", "r3")}
    costs.observe(4, drafted=6, seconds=0.078 + 6 * 0.030, source="draft")
    assert costs.drafting_requests(4, "draft") == 0  # 30 ms a token, 19.5 ms saved by one
    assert costs.worth_verifying(4, mixed, verifying=False) == {"r1": mixed["r1"]}
    costs.observe(4, drafted=3, seconds=0.078 + 3 * 0.015, source="ngram")
    assert costs.drafting_requests(4, "ngram") == EVERY_REQUEST
    assert costs.drafting_requests(2, "ngram") == EVERY_REQUEST  # priced from batch 4's


def test_match_windows_are_checked():
    with pytest.raises(ValueError, match="match windows"):
        NgramProposer(context_len=10, num_draft_tokens=4, min_match=3, max_match=2)


def test_measured_costs_set_the_acceptance_drafts_need():
    costs = SpeculationCosts()
    # A batch size's first steps are plain; its plain cost the least of them (the first runs
    # cold), a moving average after.
    for seconds in (0.014, 0.010, 0.011):
        assert not costs.allows_drafts(1)
        costs.observe(1, drafted=0, seconds=seconds, source="")
    assert costs.allows_drafts(1)
    assert costs.plain[1] == pytest.approx(0.010)
    assert costs.break_even(1, 8, "draft") == LOW_ACCEPTANCE  # no speculative step measured yet
    # A draft model as slow as the target, and n-gram drafts (their verification rows only).
    costs.observe(1, drafted=8, seconds=0.010 + 8 * 0.011, source="draft")
    costs.observe(1, drafted=8, seconds=0.010 + 8 * 0.001, source="ngram")
    assert costs.break_even(1, 8, "draft") == pytest.approx(1.1)
    assert costs.break_even(1, 8, "ngram") == pytest.approx(0.1)
    length = DraftLength(8)
    length.record(8, 7, costs.break_evens(1, 8, "draft"))
    length.record(8, 8, costs.break_evens(1, 8, "draft"))  # 15 of 16 accepted
    assert length.paused == PAUSE_STEPS << (MAX_BACKOFF - 1)  # a draft that cannot pay: long
    length = DraftLength(8)
    length.record(8, 2, costs.break_evens(1, 8, "ngram"))
    length.record(8, 2, costs.break_evens(1, 8, "ngram"))  # 4 of 16: pays
    assert not length.paused
    for failures in range(1, MAX_BACKOFF + 2):  # rejected again and again: pauses double
        length.paused = 0
        length.record(16, 0, costs.break_evens(1, 16, "ngram"))
        assert length.paused == PAUSE_STEPS << (min(failures, MAX_BACKOFF) - 1)
    # Plain steps keep the plain cost current, one in PLAIN_PROBE_EVERY; the source whose
    # drafts cannot pay is tried after HOPELESS_PROBE_FIRST steps, then after gaps that double
    # up to HOPELESS_PROBE_MAX; the other every step.
    steps = 4 * HOPELESS_PROBE_MAX
    ngram_steps, draft_probes = 0, []
    for step in range(steps):
        if costs.allows_drafts(1):
            ngram_steps += costs.pays(1, "ngram")
            if costs.pays(1, "draft"):
                assert costs.pays(1, "draft")  # a probe answers every question at its step
                draft_probes.append(step)
    assert ngram_steps == steps - steps // PLAIN_PROBE_EVERY
    gaps = [later - earlier for earlier, later in zip([-1] + draft_probes, draft_probes)]
    expected = [HOPELESS_PROBE_FIRST << i for i in range(7)] + [HOPELESS_PROBE_MAX] * 2
    assert len(gaps) == len(expected)
    for gap, due in zip(gaps, expected):
        assert due <= gap <= due + 1  # one more where it fell on a plain step
    sources = costs.info()["1"]["sources"]
    assert sources["ngram"]["break_even_acceptance"]["8"] == pytest.approx(0.1)
    assert sources["draft"]["ms_per_drafted_token"] == pytest.approx(11.0)


def test_a_source_priced_hopeless_by_one_slow_step_is_tried_again_soon():
    """One verification slowed by interference (a shared host) prices n-gram drafts above what
    an accepted token saves: they are tried again HOPELESS_PROBE_FIRST steps later, not a
    thousand (that step verifies them whatever they are likely to save), and once that
    probe's cost brings their price below, every step drafts again."""
    costs = SpeculationCosts()
    for _ in range(PLAIN_WARMUP_STEPS):
        costs.allows_drafts(4)
        costs.observe(4, drafted=0, seconds=0.078, source="")
    assert costs.allows_drafts(4)
    costs.observe(4, drafted=3, seconds=0.078 + 3 * 0.025, source="ngram")  # 19.5 ms saved
    refused = 0
    guess = {"r": Proposal([5, 6, 7], "ngram", share=0.9)}  # 0.9 x 19.5 ms < 25 ms a token
    while costs.allows_drafts(4) and costs.drafting_requests(4, "ngram") == 0:
        refused += 1
        assert costs.worth_verifying(4, guess, verifying=False) == {}
    assert refused == HOPELESS_PROBE_FIRST
    assert costs.drafting_requests(4, "ngram") == EVERY_REQUEST  # the probe, asked again
    assert costs.worth_verifying(4, guess, verifying=False) == guess  # a probe verifies them
    costs.observe(4, drafted=3, seconds=0.078 + 3 * 0.010, source="ngram")
    for _ in range(HOPELESS_PROBE_FIRST):
        assert costs.allows_drafts(4)
        assert costs.drafting_requests(4, "ngram") == EVERY_REQUEST


def test_a_cold_first_verification_weighs_as_one_of_the_first_few():
    """The cost fit is the plain mean of its first 1 / COST_SMOOTHING steps: a first step at
    twice the cost, then seven as expected, leaves their mean, not most of the first."""
    fit = DraftCostFit()
    fit.add(8, 0.200)
    for _ in range(7):
        fit.add(8, 0.100)
    assert fit.coefficients() == pytest.approx((0.0, 0.1125 / 8))


def test_in_a_batch_an_accepted_token_saves_only_its_requests_share_of_the_step():
    """Four requests decode four tokens a step: a token accepted for one of them saves a
    quarter of that step, so the same verification rows need four times the acceptance."""
    costs = SpeculationCosts()
    for batch in (1, 4):
        costs.observe(batch, drafted=0, seconds=0.010 * (1 + 0.5 * (batch - 1)), source="")
        costs.observe(
            batch, drafted=8, seconds=0.010 * (1 + 0.5 * (batch - 1)) + 8 * 0.002, source="ngram"
        )
    assert costs.break_even(1, 8, "ngram") == pytest.approx(0.2)
    assert costs.break_even(4, 8, "ngram") == pytest.approx(0.002 / (0.025 / 4))  # 0.32
    costs.observe(4, drafted=8, seconds=0.025 + 8 * 0.007, source="draft")
    # 7 ms per drafted token against a request's 6.25 ms share of the step: never pays
    assert costs.break_even(4, 8, "draft") == pytest.approx(1.12)


def test_a_verification_has_a_fixed_cost_so_short_drafts_need_more_acceptance():
    costs = SpeculationCosts()
    costs.observe(1, drafted=0, seconds=0.010, source="ngram")
    for _ in range(20):  # a pass costs 2 ms of its own and 1 ms per drafted token
        for drafted in (1, 2, 8):
            costs.observe(1, drafted, seconds=0.010 + 0.002 + 0.001 * drafted, source="ngram")
    info = costs.info()["1"]["sources"]["ngram"]
    assert info["verify_fixed_ms"] == pytest.approx(2.0)
    assert info["ms_per_drafted_token"] == pytest.approx(1.0)
    assert costs.break_even(1, 1, "ngram") == pytest.approx(0.3)  # 3 ms against a 10 ms step
    assert costs.break_even(1, 8, "ngram") == pytest.approx(0.125)
    # One accepted token in four: pays for drafts of 8 tokens, not for drafts of 1.
    long_drafts, short_drafts = DraftLength(8), DraftLength(8)
    for _ in range(2):
        long_drafts.record(8, 2, costs.break_evens(1, 8, "ngram"))
    short_drafts.current = 1
    for i in range(16):  # one token at a time, every fourth accepted
        short_drafts.record(1, int(i % 4 == 0), costs.break_evens(1, 1, "ngram"))
        short_drafts.current = 1
    assert not long_drafts.paused
    assert short_drafts.paused
    # Drafts all of one length cannot separate the fixed part: it is counted per token.
    same = SpeculationCosts()
    same.observe(1, drafted=0, seconds=0.010, source="ngram")
    same.observe(1, drafted=4, seconds=0.010 + 0.006, source="ngram")
    assert same.info()["1"]["sources"]["ngram"]["verify_fixed_ms"] == 0.0
    assert same.break_even(1, 1, "ngram") == same.break_even(1, 4, "ngram") == pytest.approx(0.15)


def test_a_draft_models_fixed_cost_is_the_verifications_measured_by_ngram_drafts():
    """Steps timed with noise: a draft model whose drafts were all 2 or 4 tokens long cannot
    tell a fixed part from its cost per token (a free fit of these steps finds 38 ms fixed
    and 1 ms per token: long drafts would look almost free), so it takes the
    verification's fixed part from the n-gram drafts, whose lengths vary: 2 ms, and fits
    what is left per token (about 12 ms, its true 10 plus the noise)."""
    costs = SpeculationCosts()
    costs.observe(1, drafted=0, seconds=0.030, source="")
    for _ in range(20):
        for drafted in (1, 4, 16):
            costs.observe(1, drafted, seconds=0.030 + 0.002 + 0.005 * drafted, source="ngram")
        for drafted, noise in ((2, 0.018), (4, 0.0)):
            costs.observe(
                1, drafted, seconds=0.030 + 0.002 + 0.010 * drafted + noise, source="draft"
            )
    free = costs.fits[(1, "draft")].coefficients()
    assert free[0] > 0.030 and free[1] < 0.002
    fixed, per_token = costs.coefficients(1, "draft")  # type: ignore[misc]
    assert fixed == pytest.approx(0.002)
    assert 0.010 < per_token < 0.013
    assert costs.marginal(1, "draft") == pytest.approx(per_token / 0.030)
    assert costs.info()["1"]["sources"]["draft"]["verify_fixed_ms"] == pytest.approx(2.0)
    alone = SpeculationCosts()  # no n-gram drafts measured: no fixed part
    alone.observe(1, drafted=0, seconds=0.030, source="")
    alone.observe(1, drafted=4, seconds=0.030 + 0.040, source="draft")
    assert alone.coefficients(1, "draft") == pytest.approx((0.0, 0.010))


def test_a_short_draft_above_break_even_does_not_stop_drafts_that_pay_when_longer():
    """Four requests at once, drafts whose verification has a fixed cost: a step of few
    drafted tokens needs more than all of them, but longer drafts pay at 90% accepted, so the
    requests keep drafting (the longest pause is for drafts that cannot pay at any length)."""
    costs = SpeculationCosts()
    costs.observe(4, drafted=0, seconds=0.052, source="")
    for _ in range(20):
        for drafted in (8, 16, 48):
            costs.observe(4, drafted, seconds=0.052 + 0.030 + 0.008 * drafted, source="ngram")
    first = FIRST_DRAFT_TOKENS
    short, longest = costs.break_evens(4, first, "ngram"), costs.break_evens(4, 48, "ngram")
    assert short.needed > 1.0 > longest.needed > short.least  # 1.19, 0.66 and 0.62
    length = DraftLength(8)
    length.record(first, first, short)  # a short step, all accepted
    assert not length.paused and length.current == UNGROUPED_ROWS.grown(first, 8)
    for _ in range(3):  # then longer drafts, 90% accepted
        length.record(8, 7, costs.break_evens(4, 32, "ngram"))
    assert not length.paused
    hopeless = SpeculationCosts()
    hopeless.observe(4, drafted=0, seconds=0.052, source="")
    hopeless.observe(4, drafted=8, seconds=0.052 + 8 * 0.014, source="draft")
    assert hopeless.break_evens(4, 8, "draft").least > 1.0
    length = DraftLength(8)
    length.record(4, 4, hopeless.break_evens(4, 4, "draft"))
    assert length.paused == PAUSE_STEPS << (MAX_BACKOFF - 1)


# --------------------------------------------------------------------------- end to end
def _passes(engine) -> int:
    return engine.get_server_info()["forward_passes"]


def test_greedy_outputs_are_identical_and_copying_takes_fewer_passes(engine, engine_ngram):
    """One request at a time, then the copy and free prompts mixed in one batch of four."""
    for prompt in [*COPY_PROMPTS[:2], FREE_PROMPTS[0]]:
        engine.flush_cache(), engine_ngram.flush_cache()
        before = _passes(engine), _passes(engine_ngram)
        plain = engine.generate(prompt, GREEDY)
        spec = engine_ngram.generate(prompt, GREEDY)
        passes = _passes(engine) - before[0], _passes(engine_ngram) - before[1]
        assert spec["output_ids"] == plain["output_ids"], prompt
        meta = spec["meta_info"]
        assert meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
        assert passes[1] <= passes[0] - meta["spec_accepted_tokens"] + 1
        if prompt == COPY_PROMPTS[0]:  # the passage repeated: most tokens come from drafts
            assert meta["spec_accepted_tokens"] >= 0.5 * meta["completion_tokens"], meta
            assert passes[1] < 0.6 * passes[0], passes
    batch = [COPY_PROMPTS[0], FREE_PROMPTS[0], COPY_PROMPTS[1], FREE_PROMPTS[1]]
    params = [{**GREEDY, "max_new_tokens": n} for n in (32, 16, 24, 8)]
    want = engine.generate(batch, params)
    got = engine_ngram.generate(batch, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0


def test_budgets_stops_logprobs_n_and_the_cache_behave_as_without(engine, engine_ngram):
    prompt = COPY_PROMPTS[0]
    short = engine_ngram.generate(prompt, {**GREEDY, "max_new_tokens": 5})
    assert short["meta_info"]["completion_tokens"] == 5
    stop = {**GREEDY, "stop": [" keeper"]}
    want, got = engine.generate(prompt, stop), engine_ngram.generate(prompt, stop)
    assert got["text"] == want["text"] and "keeper" not in got["text"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    lp = {**GREEDY, "max_new_tokens": 24}
    want = engine.generate(prompt, lp, return_logprob=True)
    got = engine_ngram.generate(prompt, lp, return_logprob=True)
    assert got["meta_info"]["spec_accepted_tokens"] > 0
    ours, theirs = (o["meta_info"]["output_token_logprobs"] for o in (got, want))
    assert len(ours) == len(theirs) == 24
    for (g, g_id, _), (w, w_id, _) in zip(ours, theirs, strict=True):
        assert g_id == w_id and abs(g - w) < 1e-3
    both = engine_ngram.generate(prompt, {**GREEDY, "n": 2})
    alone = engine.generate(prompt, GREEDY)["output_ids"]
    assert len(both) == 2
    assert all(o["output_ids"] == alone for o in both)
    cached = engine_ngram.generate(prompt, GREEDY)  # its prompt now in the radix cache
    assert cached["meta_info"]["cached_tokens"] > 0 and cached["output_ids"] == alone


def test_a_prompt_asked_again_drafts_its_earlier_answer_from_the_cache(engine, engine_ngram):
    """Free text has nothing to copy from its own prompt; the second time it is asked, the
    first answer is in the radix cache and drafts nearly all of it."""
    prompt = CHAT.format("Describe a quiet morning in a small village.")
    engine_ngram.flush_cache()
    first = engine_ngram.generate(prompt, GREEDY)
    before = _passes(engine_ngram)
    again = engine_ngram.generate(prompt, GREEDY)
    passes = _passes(engine_ngram) - before
    assert (
        again["output_ids"] == first["output_ids"] == engine.generate(prompt, GREEDY)["output_ids"]
    )
    meta = again["meta_info"]
    assert meta["spec_accepted_tokens"] >= 0.8 * meta["completion_tokens"], meta
    assert passes <= 0.3 * meta["completion_tokens"], passes


def test_streaming_delivers_the_accepted_drafts_as_they_come(engine, engine_ngram):
    prompt = COPY_PROMPTS[0]
    want = engine.generate(prompt, GREEDY)["text"]
    chunks = list(engine_ngram.generate(prompt, GREEDY, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text must be cumulative"
    assert texts[-1] == want
    # A verification emits several tokens at once: fewer chunks than tokens.
    assert len(chunks) < chunks[-1]["meta_info"]["completion_tokens"]


def test_grammar_requests_combine_speculation_with_jump_forward(engine, engine_ngram):
    document = "Name: Ada Lovelace. Age: 36. City: London."
    prompt = CHAT.format(f"Fill a JSON record from this document:\n\n{document}")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = {**GREEDY, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    want, got = engine.generate(prompt, params), engine_ngram.generate(prompt, params)
    assert got["output_ids"] == want["output_ids"]
    record = json.loads(got["text"])
    assert set(record) == {"name", "age"}
    assert got["meta_info"]["jump_forward_accepted_tokens"] > 0  # forced keys still jump


def test_seeded_sampling_draws_the_same_tokens(engine, engine_ngram):
    """Every emitted token is the model's own sample with the request's own generator, so a
    seeded request answers as without speculation (up to float rounding between the passes'
    logits), and the answers are distributed the same."""
    n = 16
    params = [{"temperature": 1.0, "max_new_tokens": 24, "seed": s} for s in range(n)]
    want, got = [], []
    for i in range(0, n, 4):  # batches small enough to speculate
        chunk = params[i : i + 4]
        want += engine.generate([COPY_PROMPTS[0]] * len(chunk), chunk)
        got += engine_ngram.generate([COPY_PROMPTS[0]] * len(chunk), chunk)
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0
    a = collections.Counter(o["text"] for o in got)
    b = collections.Counter(o["text"] for o in want)
    assert len(b) >= 4  # the samples really vary
    same = sum(x["output_ids"] == y["output_ids"] for x, y in zip(got, want, strict=True))
    assert same >= n - 1, same  # one near-tie flipped by the passes' rounding at most
    distance = sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / (2 * n)
    assert distance <= 0.1, (a, b)


def test_server_reports_speculation(engine_ngram):
    info = engine_ngram.get_server_info()
    assert info["spec_draft_tokens"] >= info["spec_accepted_tokens"] > 0
    assert info["spec_verify_passes"] > 0


def test_bad_speculative_arguments_are_refused():
    import sglite

    with pytest.raises(ValueError, match="speculative_algorithm"):
        sglite.Engine(speculative_algorithm="eagle9")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        sglite.Engine(speculative_algorithm="ngram", speculative_num_draft_tokens=0)


def test_metrics_export_the_draft_counters(sglite_server):
    text = requests.get(sglite_server.url + "/metrics", timeout=30).text
    for name in ("spec_draft_tokens", "spec_accepted_tokens", "jump_forward_accepted_tokens"):
        assert f"sglite:{name}_total " in text, name


def test_slot_table_follows_a_rejected_draft():
    """A rejected draft's slots are cut from a request's list and later slots appended in their
    place need not be the same: the decode batch's tensor copy must show the new ones."""
    from sglite.runtime.scheduler.request import SlotMirror

    slots = [10, 11, 12, 13, 14]
    mirror = SlotMirror()
    assert mirror.view(slots).tolist() == slots
    del slots[3:]  # draft verification keeps the first three
    mirror.truncate(3)
    slots += [40, 41]  # the next tokens' slots come from the free list
    assert mirror.view(slots).tolist() == [10, 11, 12, 40, 41]
