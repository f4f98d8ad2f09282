"""Draft-model speculative decoding (`--speculative-algorithm draft`): a second model with the
target's tokenizer proposes each draft and keeps its own KV pool and radix cache, which follow
the target's accepted tokens. Outputs are those of decoding without it.

Tiny random transformers models with one word-level tokenizer: a 4-layer target; as drafts,
the target itself (it agrees with itself, so a draft KV that did not follow the accepted tokens,
or a stale cached prefix, would show as rejected drafts), a different 1-layer model, and the
target's own first layer (self-speculation by early exit)."""

from __future__ import annotations

import pytest
import torch
from test_loader import PROMPT, make_hf_model

import sglite
from sglite.runtime.scheduler.speculation import EVERY_REQUEST, FIRST_DRAFT_TOKENS, BreakEvens
from sglite.runtime.server_args import ServerArgs

GREEDY = {"temperature": 0, "max_new_tokens": 24}
PROMPTS = [PROMPT, PROMPT[2:], PROMPT[:6] * 2, PROMPT[1:8]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("draft")
    paths = {"target": str(root / "target"), "small": str(root / "small")}
    make_hf_model("llama", paths["target"], num_hidden_layers=4)
    small = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 48}
    make_hf_model("llama", paths["small"], **small)
    return paths


def _engine(tiny: dict[str, str], **kwargs) -> sglite.Engine:
    return sglite.Engine(model_path=tiny["target"], dtype="float32", log_level="error", **kwargs)


@pytest.fixture(scope="module")
def plain(tiny):
    eng = _engine(tiny)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def self_draft(tiny):
    eng = _engine(
        tiny,
        speculative_algorithm="draft",
        speculative_draft_model_path=tiny["target"],
        speculative_adaptive=False,  # drafts counted below must not depend on step timings
        speculative_draft_ngram=False,  # every draft is the draft model's
    )
    yield eng
    eng.shutdown()


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_an_agreeing_draft_is_accepted_and_outputs_are_identical(plain, self_draft):
    self_draft.flush_cache()
    assert self_draft.get_server_info()["speculative_draft"]["cached_tokens"] == 0
    for _ in range(2):  # the second time the draft model's own cache holds the prompt
        want = plain.generate(input_ids=PROMPT, sampling_params=GREEDY)
        got = self_draft.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert got["output_ids"] == want["output_ids"]
        meta = got["meta_info"]
        assert meta["spec_accepted_tokens"] >= 0.9 * meta["spec_draft_tokens"] > 0, meta
        # Each verification emits its accepted tokens plus one of the target's own (drafts
        # grow as the draft model's flat probabilities prove to understate its agreement).
        assert meta["spec_verify_ct"] <= meta["completion_tokens"] // 3, meta
    info = self_draft.get_server_info()
    # The prompt and the output up to the last proposal.
    assert info["speculative_draft"]["cached_tokens"] >= len(PROMPT) + GREEDY["max_new_tokens"] // 2
    params = [{**GREEDY, "max_new_tokens": n} for n in (24, 9, 17, 5)]
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    got = self_draft.generate(input_ids=PROMPTS, sampling_params=params)
    assert _ids(got) == _ids(want)
    self_draft.check_invariants()
    self_draft.flush_cache()
    assert self_draft.get_server_info()["speculative_draft"]["cached_tokens"] == 0


def test_stops_logprobs_and_seeded_sampling_behave_as_without(plain, self_draft):
    stop = {**GREEDY, "stop_token_ids": [plain.generate(input_ids=PROMPT, sampling_params=GREEDY)[
        "output_ids"][6]]}  # fmt: skip
    want = plain.generate(input_ids=PROMPT, sampling_params=stop)
    got = self_draft.generate(input_ids=PROMPT, sampling_params=stop)
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    want = plain.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    got = self_draft.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    ours, theirs = (o["meta_info"]["output_token_logprobs"] for o in (got, want))
    assert [t for _, t, _ in ours] == [t for _, t, _ in theirs]
    assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(ours, theirs, strict=True)) < 1e-4
    seeded = [{"temperature": 1.0, "max_new_tokens": 16, "seed": s} for s in range(4)]
    want = plain.generate(input_ids=[PROMPT] * 4, sampling_params=seeded)
    got = self_draft.generate(input_ids=[PROMPT] * 4, sampling_params=seeded)
    assert len({tuple(ids) for ids in _ids(want)}) >= 2  # the samples really vary
    same = sum(a == b for a, b in zip(_ids(got), _ids(want), strict=True))
    assert same >= 3, same  # one near-tie flipped by the passes' rounding at most
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0


def test_ngram_matches_draft_before_the_draft_model(tiny, plain):
    """By default a draft model's engine drafts from text already seen where it can: a prompt
    asked again drafts its earlier answer from the radix cache, free, and the draft model only
    where no match exists; outputs stay the target's own."""
    eng = _engine(
        tiny,
        speculative_algorithm="draft",
        speculative_draft_model_path=tiny["small"],
        speculative_adaptive=False,
    )
    try:
        want = plain.generate(input_ids=PROMPT, sampling_params=GREEDY)
        first = eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
        info = eng.get_server_info()
        assert info["speculative_draft_ngram"] is True
        by_model = info["speculative_proposals"]["draft"]
        assert by_model > 0
        passes = info["speculative_draft"]["forward_passes"]
        again = eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert first["output_ids"] == again["output_ids"] == want["output_ids"]
        info = eng.get_server_info()
        assert info["speculative_proposals"]["ngram"] > 0
        # The cached answer was accepted whole (drafts of 16, then the rest): a few
        # verifications, no draft-model pass.
        meta = again["meta_info"]
        assert meta["spec_verify_ct"] <= 3, meta
        assert meta["spec_accepted_tokens"] >= GREEDY["max_new_tokens"] - 1 - 3, meta
        assert info["speculative_draft"]["forward_passes"] <= passes + 2
        eng.check_invariants()
    finally:
        eng.shutdown()


def test_server_info_describes_the_draft_model(tiny, self_draft):
    self_draft.generate(input_ids=PROMPT, sampling_params=GREEDY)  # run alone, it drafts too
    info = self_draft.get_server_info()
    assert info["speculative_algorithm"] == "draft"
    draft = info["speculative_draft"]
    assert draft["model_path"] == info["model_path"]
    assert draft["num_layers"] == 4 and draft["quantization"] == "none"
    assert draft["pool_tokens"] > 0 and draft["forward_passes"] > 0


@pytest.mark.parametrize("draft", ["small", "early exit"])
def test_a_smaller_draft_model_and_an_early_exit_draft_leave_outputs_unchanged(tiny, plain, draft):
    flags = {"speculative_draft_model_path": tiny["small"]}
    if draft == "early exit":
        flags = {"speculative_draft_model_path": tiny["target"], "speculative_draft_num_layers": 1}
    params = [{**GREEDY, "max_new_tokens": n} for n in (24, 17, 9)]
    want = plain.generate(input_ids=PROMPTS[:3], sampling_params=params)
    eng = _engine(tiny, speculative_algorithm="draft", **flags)
    try:
        got = eng.generate(input_ids=PROMPTS[:3], sampling_params=params)
        assert _ids(got) == _ids(want)
        assert sum(o["meta_info"]["spec_draft_tokens"] for o in got) > 0
        info = eng.get_server_info()
        assert info["speculative_draft"]["num_layers"] == 1
        assert "3" in info["speculative_costs"]  # measured per batch size (3, then fewer)
        eng.check_invariants()
    finally:
        eng.shutdown()


def test_bad_draft_model_arguments_are_refused(tiny):
    from sglite.runtime.model.loader import default_model_path, load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="draft").validate()
    with pytest.raises(ValueError, match="speculative_algorithm='draft' only"):
        ServerArgs(speculative_draft_model_path="x").validate()
    with pytest.raises(ValueError, match="speculative_draft_num_layers"):
        ServerArgs(
            speculative_algorithm="standalone",  # SGLang's name
            speculative_draft_model_path="x",
            speculative_draft_num_layers=0,
        ).validate()
    target = load_model(tiny["target"], dtype="float32", progress=False)
    args = ServerArgs(
        model_path=tiny["target"],
        speculative_algorithm="draft",
        speculative_draft_model_path=default_model_path(),
    )
    with pytest.raises(ValueError, match="vocabulary differs"):
        DraftModelProposer.load(args, target, context_len=128, capacity=256)


def test_a_draft_models_pass_over_a_new_prompt_is_not_counted_as_draft_cost(tiny):
    """The draft model's first pass reads the request's whole prompt: a one-time cost that
    `take_prompt_seconds` reports (and the decode step leaves out of the drafts' measured
    cost), once; the next proposal, one token later, reads no prompt."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    proposer.needed = 0.0  # every draft token pays: drafts as long as the draft length
    req = _request("r", PROMPT * 4)
    draft = proposer.propose(req)
    assert len(draft) == FIRST_DRAFT_TOKENS
    assert proposer.take_prompt_seconds() > 0.0
    assert proposer.take_prompt_seconds() == 0.0  # taken: reset
    # The target kept one draft token, then emitted its own: the draft model reads that one.
    own = PROMPT[0] if PROMPT[0] != draft[1] else PROMPT[1]
    req.output_ids.extend([draft[0], own])
    assert len(proposer.propose(req)) > 0
    assert proposer.take_prompt_seconds() == 0.0
    proposer.forget(set())
    proposer.check_invariants()


def test_the_draft_model_reads_a_prompt_as_the_target_prefills_it(tiny, plain):
    """The draft model's pass over a new prompt runs in the prefill step: a request that
    decoded one token without any draft (the first step at a batch size measures the plain
    cost) leaves its prompt in the draft model's cache, and a proposer that read the prompt
    drafts with one pass per token, reading no prompt then."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    eng = _engine(
        tiny,
        speculative_algorithm="draft",
        speculative_draft_model_path=tiny["small"],
        speculative_draft_ngram=False,
    )
    try:
        params = {**GREEDY, "max_new_tokens": 2}
        got = eng.generate(input_ids=PROMPT, sampling_params=params)
        assert got["output_ids"] == plain.generate(input_ids=PROMPT, sampling_params=params)[
            "output_ids"]  # fmt: skip
        assert got["meta_info"]["spec_draft_tokens"] == 0
        assert eng.get_server_info()["speculative_draft"]["cached_tokens"] >= len(PROMPT)
        eng.check_invariants()
    finally:
        eng.shutdown()
    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    proposer.needed = 0.0  # drafts as long as the draft length
    req = _request("r", PROMPT * 4)
    proposer.read_prompt(req)
    assert proposer.kv.forward_passes == 1
    req.output_ids.append(PROMPT[0])
    assert len(proposer.propose(req)) == FIRST_DRAFT_TOKENS
    assert proposer.kv.forward_passes == 1 + FIRST_DRAFT_TOKENS
    assert proposer.take_prompt_seconds() == 0.0
    proposer.forget(set())
    proposer.check_invariants()


def _request(rid: str, prompt: list[int], max_new_tokens: int = 16):
    """A scheduler request of 16 new tokens at most (or `max_new_tokens`)."""
    import time

    from sglite.runtime.sampling.params import SamplingParams
    from sglite.runtime.sampling.request_state import SamplingInfo
    from sglite.runtime.scheduler.request import Req

    params = SamplingParams.from_dict({"max_new_tokens": max_new_tokens})
    sampling = SamplingInfo.create(params, prompt)
    return Req(rid, prompt, params, sampling, None, None, time.time())  # type: ignore[arg-type]


def test_one_long_draft_missed_at_its_first_token_does_not_pause_a_paying_request(tiny):
    """A request whose drafts pay (most of their tokens kept) goes on drafting after a long
    draft the target rejected at its first token: the draft model judges it by its tallies,
    not by a window of its last drafts (`DraftLength.pauses` off), whose verdict here would
    have paused it for PAUSE_STEPS steps while the draft model fell behind on its text."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.speculation import PAUSE_AFTER, DraftLength

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 15, 256)
    req = _request("r", PROMPT, max_new_tokens=200)
    shares = BreakEvens(0.5, 0.5)
    kept = [(4, 4), (8, 8), (4, 4), (3, 3)]  # 19 of 19 kept, then 0 of 15: a window of 18
    window = DraftLength(15)  # tokens (after one of 16) with 3 kept where 9 were needed
    for drafted, accepted in [*kept, (15, 0)]:
        assert proposer.propose(req)
        proposer.record(req, drafted, accepted, shares)
        window.record(drafted, accepted, shares)
        req.output_ids.extend((PROMPT * 2)[: accepted + 1])
    assert kept[-1][0] + 15 >= PAUSE_AFTER and window.paused
    assert proposer.propose(req)
    proposer.forget(set())
    proposer.check_invariants()


def test_a_fresh_servers_first_drafts_are_not_judged_on_one_draft(tiny):
    """On a fresh server, a first draft rejected (with the prior's 2 of 4, a share below a
    long draft's break-even of 0.72) does not stop the request's drafts: while neither the
    workload's drafts nor the request's hold MIN_EVIDENCE_TOKENS tokens, the draft model
    drafts on to learn (a draft not made teaches nothing); every other draft kept whole, it
    judges them once they do, and half kept does not pay."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_tally import MIN_EVIDENCE_TOKENS

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    proposer.pass_cost.pass_seconds, proposer.pass_cost.passes_per_token[1] = 0.012, 1.0
    shares = BreakEvens(0.72, 0.72, 0.03)  # a plain step of 30 ms: a pass and a row cost 72%
    proposer.price(lambda source: shares)
    req = _request("r", PROMPT, max_new_tokens=200)
    drafted = []
    while draft := proposer.propose(req):  # every other draft kept whole: half the tokens
        kept = len(draft) * (len(drafted) % 2)
        proposer.record(req, len(draft), kept, shares)
        req.output_ids.extend((PROMPT * 20)[len(req.output_ids) :][: kept + 1])
        drafted.append(len(draft))
        assert len(drafted) < 60, "half kept never judged"
    assert sum(drafted) >= MIN_EVIDENCE_TOKENS  # judged once there is evidence: half is short
    for _ in range(200):  # n-gram drafts preferred for long: the tally ages, its verdict stays
        proposer.passed_over()
    assert proposer.acceptance.drafted < MIN_EVIDENCE_TOKENS
    fresh = _request("s", PROMPT[1:], max_new_tokens=200)
    proposer.read_prompt(fresh)
    fresh.output_ids.append(PROMPT[0])
    assert proposer.propose(fresh) == []
    proposer.forget(set())
    proposer.check_invariants()


def test_a_draft_model_below_its_break_even_stops_drafting_for_new_requests_too(tiny):
    """Its drafts' accepted share is kept over all requests: after verifications that kept
    too little for the measured break-even, a new request gets no draft model draft but the
    rare probe (`KindAcceptance`), instead of relearning from its own first drafts."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_tally import KIND_PROBE_EVERY

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    first = _request("a", PROMPT)
    assert proposer.propose(first)  # the prior share pays at the default break-even
    for _ in range(6):  # each draft of 4 kept 1 token, where 90% was needed
        proposer.record(first, 4, 1, BreakEvens(0.9, 0.9))
    proposer.forget(set())
    fresh = [_request(f"r{i}", PROMPT[i:]) for i in range(KIND_PROBE_EVERY)]
    for req in fresh:
        proposer.read_prompt(req)  # as the target prefills it
        req.output_ids.append(PROMPT[0])  # the prefill's token: a first decode step
    drafts = [proposer.propose(req) for req in fresh]  # one step each
    assert [bool(d) for d in drafts] == [False] * (KIND_PROBE_EVERY - 1) + [True]  # one probe
    assert proposer.info()["speculative_draft"]["drafts"]["recent_acceptance"] < 0.9
    proposer.forget(set())
    # a batch's requests asked in one step count once toward the probe gap (a probe adds rows
    # to the whole batch's verification)
    batch = [_request(f"b{i}", PROMPT[i:]) for i in range(4)]
    for req in batch:
        proposer.read_prompt(req)
        req.output_ids.append(PROMPT[0])
    assert proposer.acceptance.refused == 0  # the probe above
    for step in range(5):
        assert proposer.propose_many(batch) == {}
        for req in batch:  # each step writes a token of each request's own
            req.output_ids.append(PROMPT[1 + step])
    assert proposer.acceptance.refused == 5
    proposer.forget(set())
    proposer.check_invariants()


def test_a_request_whose_own_drafts_fail_stops_drafting_though_earlier_ones_paid(tiny):
    """After requests whose drafts were kept whole (a copy workload), a request writing text the
    draft model does not foresee stops drafting after its first failed drafts, without waiting
    for the tally of all requests to fall; a new request still starts drafting."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.sampling.params import SamplingParams
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    copying = _request("copy", PROMPT)
    assert proposer.propose(copying)
    for _ in range(30):
        proposer.record(copying, 4, 4, BreakEvens(0.8, 0.8))
    proposer.forget(set())
    new_text = _request("new", PROMPT)
    new_text.params = SamplingParams.from_dict({"max_new_tokens": 200})
    drafts = []
    for i in range(6):
        new_text.output_ids.append(PROMPT[i])
        draft = proposer.propose(new_text)
        drafts.append(len(draft))
        if draft:
            proposer.record(new_text, len(draft), 0, BreakEvens(0.8, 0.8))
    # a first draft of its own rejected
    assert drafts[0] == FIRST_DRAFT_TOKENS and drafts[1:] == [0] * 5
    assert proposer.acceptance.covers_cost()  # all requests' drafts still pay
    assert proposer.propose(_request("next", PROMPT))
    proposer.forget(set())
    proposer.check_invariants()


def test_a_probe_waits_for_a_request_the_draft_model_is_in_step_with(tiny):
    """A probe of a non-paying draft model would first catch up on every token a request
    emitted since the draft model last followed it: where the request's remaining tokens would
    not repay that (priced as `_catch_up_pays` prices it), the probe that falls due there is
    deferred to the next request the draft model holds all but a few tokens of; a long request
    whose prompt went unread gets it, its catch-up included (else no probe comes while it
    runs)."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import (
        PROBE_MAX_BEHIND,
        PROMPT_READ_EVERY_UNPAID,
        DraftModelProposer,
    )

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    first = _request("a", PROMPT)
    proposer.read_prompt(first)
    first.output_ids.append(PROMPT[0])
    assert proposer.propose(first)
    for _ in range(6):
        proposer.record(first, 4, 0, BreakEvens(0.9, 0.9))
    proposer.forget(set())
    proposer.pass_cost.catch_up_seconds, proposer.saved_seconds = 0.010, 0.030
    behind = _request("behind", PROMPT[:4])
    proposer.read_prompt(behind)
    behind.output_ids = list(PROMPT[4 : 4 + PROBE_MAX_BEHIND + 2])  # emitted while refused
    tally = proposer.acceptance
    tally.refused = tally.probe_gap  # a probe is due
    passes = proposer.kv.forward_passes
    assert proposer.propose(behind) == [] and proposer.kv.forward_passes == passes
    in_step = _request("in-step", PROMPT[1:])
    proposer.prompts_unread = PROMPT_READ_EVERY_UNPAID - 1  # this prompt is the one read
    proposer.read_prompt(in_step)
    in_step.output_ids = [PROMPT[0]]  # its first decode step: one token behind
    assert proposer.propose(in_step)  # the deferred probe
    proposer.forget(set())
    long_request = _request("long", PROMPT[2:], max_new_tokens=400)
    passes = proposer.kv.forward_passes
    proposer.read_prompt(long_request)
    assert proposer.kv.forward_passes == passes  # not read: no probe was due
    long_request.output_ids = [PROMPT[0]]
    tally.refused = tally.probe_gap
    assert proposer.propose(long_request)  # the probe, its prompt read first
    assert len(proposer.sequences["long"].tokens) > len(long_request.prompt_ids)
    proposer.forget(set())
    proposer.check_invariants()


def test_a_draft_model_catches_up_on_a_request_only_where_its_drafts_can_repay_that(tiny):
    """A request prefilled while the draft model's drafts did not pay has its prompt unread:
    once they pay again, drafting for it first costs a pass over every token it holds (priced
    at the measured seconds per token), which drafts over its last few tokens never repay, so
    it gets none and no pass runs; a request with many tokens to go is caught up and drafted."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.sampling.params import SamplingParams
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    proposer.pass_cost.catch_up_seconds = 0.010  # a token's share of a catch-up pass
    proposer.saved_seconds = 0.040  # what an accepted token saves (a plain step at batch 1)
    ending = _request("ending", PROMPT)
    ending.output_ids = list(PROMPT[:14])  # 2 of its 16 tokens left, all of it unread
    passes = proposer.kv.forward_passes
    assert proposer.propose(ending) == [] and proposer.kv.forward_passes == passes
    going = _request("going", PROMPT)
    going.params = SamplingParams.from_dict({"max_new_tokens": 200})
    going.output_ids = list(PROMPT[:14])
    assert proposer.propose(going) and proposer.kv.forward_passes > passes
    proposer.forget(set())
    proposer.check_invariants()


def test_a_draft_model_that_does_not_pay_reads_few_prompts(tiny):
    """A prompt's pass costs the draft model a prefill: while its drafts pay every new prompt
    is read as the target prefills it, while they do not only one in
    PROMPT_READ_EVERY_UNPAID (a request for a probe to try); an unread prompt is read by the
    request's first draft if drafts pay again."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import PROMPT_READ_EVERY_UNPAID, DraftModelProposer
    from sglite.runtime.scheduler.draft_tally import KindAcceptance

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    paying = [_request(f"p{i}", PROMPT[i:]) for i in range(3)]
    for req in paying:
        proposer.read_prompt(req)
    assert proposer.kv.forward_passes == len(paying)
    for _ in range(6):  # drafts of 4 that kept nothing, where 90% was needed
        proposer.record(paying[0], 4, 0, BreakEvens(0.9, 0.9))
    unpaid = [_request(f"u{i}", PROMPT[i % 4 :]) for i in range(2 * PROMPT_READ_EVERY_UNPAID)]
    read = []
    for req in unpaid:
        passes = proposer.kv.forward_passes
        proposer.read_prompt(req)
        read.append(proposer.kv.forward_passes > passes)
    one_in_n = [False] * (PROMPT_READ_EVERY_UNPAID - 1) + [True]
    assert read == one_in_n * 2
    proposer.acceptance, proposer.needed = KindAcceptance(), 0.0  # drafts pay again
    late = unpaid[0]
    late.output_ids.append(PROMPT[0])
    assert len(proposer.propose(late)) == FIRST_DRAFT_TOKENS  # its prompt read by its first draft
    assert proposer.take_prompt_seconds() > 0.0
    proposer.forget(set())
    proposer.check_invariants()


def test_a_draft_model_drafts_while_its_drafts_as_made_pay_for_their_cost(tiny):
    """Drafts are judged as the draft model makes them: the tokens accepted against what their
    verifications cost (each step's drafted tokens times its break-even, the fixed part
    included). Short drafts whose share beats a long draft's break-even but not their own
    stop (the rare probe aside); drafts whose first token is often rejected but which are
    otherwise kept whole go on, though their first tokens alone would not pay."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_tally import KIND_PROBE_EVERY

    def fresh_drafts(proposer: DraftModelProposer, tag: str) -> list[bool]:
        reqs = [_request(f"{tag}{i}", PROMPT[i:]) for i in range(KIND_PROBE_EVERY)]
        for req in reqs:
            proposer.read_prompt(req)
            req.output_ids.append(PROMPT[0])
        drafted = [bool(proposer.propose(req)) for req in reqs]
        proposer.forget(set())
        return drafted

    loaded = load_model(tiny["small"], progress=False)
    short = DraftModelProposer(loaded, 256, 4, 256)
    first = _request("a", PROMPT)
    assert short.propose(first)
    for i in range(30):  # one-token drafts kept 2 in 5, where a one-token step needs 0.6
        short.record(first, 1, int(i % 5 < 2), BreakEvens(0.6, 0.3))
    short.forget(set())
    assert fresh_drafts(short, "s") == [False] * (KIND_PROBE_EVERY - 1) + [True]  # one probe
    assert short.info()["speculative_draft"]["drafts"]["recent_acceptance"] > 0.3

    whole = DraftModelProposer(loaded, 256, 4, 256)
    first = _request("b", PROMPT)
    assert whole.propose(first)
    for i in range(30):  # every other draft's first token rejected, the others kept whole
        whole.record(first, *((6, 6) if i % 2 else (1, 0)), BreakEvens(0.5, 0.3))
    whole.forget(set())
    assert fresh_drafts(whole, "w") == [True] * KIND_PROBE_EVERY
    drafts = whole.info()["speculative_draft"]["drafts"]
    assert drafts["recent_acceptance"] > drafts["recent_break_even"]
    short.check_invariants()
    whole.check_invariants()


def test_the_draft_model_drafts_for_several_requests_in_one_pass_per_token(tiny):
    """Requests decoding together get their drafts from one batch of the draft model per
    token (a batch costs it about one request's pass), each the draft it would get alone."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    loaded = load_model(tiny["small"], progress=False)
    together, alone = (DraftModelProposer(loaded, 256, 4, 1024) for _ in range(2))
    prompts = [PROMPT[i:] + [7 + i] for i in range(3)]
    for proposer in (together, alone):
        for i, prompt in enumerate(prompts):
            proposer.read_prompt(_request(f"r{i}", prompt))

    def decoding(i: int):  # the target has emitted one token since the prefill
        req = _request(f"r{i}", prompts[i])
        req.output_ids.append(5 + i)
        return req

    passes = together.kv.forward_passes
    drafts = together.propose_many([decoding(i) for i in range(3)])
    assert len(drafts) == 3 and all(drafts.values())
    assert together.kv.forward_passes - passes == max(len(d) for d in drafts.values())
    for i in range(3):
        assert alone.propose(decoding(i)) == drafts[f"r{i}"]
    for proposer in (together, alone):
        proposer.forget(set())
        proposer.check_invariants()


def test_requests_running_together_with_one_prompt_read_it_once(tiny):
    """A batch of requests sharing a prompt (one document, one system prompt): the draft model
    reads it for the first and caches it at once, so the others' reads pass over their last
    token only; their drafts are those a proposer gets that read each prompt alone, and the
    pool's slots stay accounted while they run and after they end."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    loaded = load_model(tiny["small"], dtype="float32", progress=False)
    shared, alone = (DraftModelProposer(loaded, 256, 4, 1024) for _ in range(2))
    prompt = PROMPT * 4
    fed: list[int] = []
    forward = shared.kv.model.forward
    shared.kv.model.forward = lambda batch, pool: (  # type: ignore[method-assign]
        fed.append(batch.input_ids.numel()) or forward(batch, pool)
    )
    for i in range(3):
        shared.read_prompt(_request(f"r{i}", prompt))
        shared.check_invariants()
    assert fed == [len(prompt), 1, 1]
    assert shared.kv.cache.total_size() >= len(prompt)

    def decoding(rid: str):  # the target has emitted one token since the prefill
        req = _request(rid, prompt)
        req.output_ids.append(5)
        return req

    drafts = shared.propose_many([decoding(f"r{i}") for i in range(3)])
    shared.check_invariants()
    alone.read_prompt(_request("a", prompt))
    own = alone.propose(decoding("a"))
    assert own and drafts == {f"r{i}": own for i in range(3)}
    for proposer in (shared, alone):
        proposer.forget(set())
        proposer.check_invariants()


def test_a_catch_up_of_several_tokens_runs_as_decode_rows_with_the_same_draft(tiny, monkeypatch):
    """A request the draft model fell behind on (tokens emitted while it did not draft) is
    caught up in its next pass, one DECODE row per token (25 of them here): the draft is the
    one an EXTEND of those tokens gives, and the draft model holds the same tokens after it."""
    from sglite.runtime.model.forward_batch import ForwardMode
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler import draft_model_kv
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    rows, extend = (
        DraftModelProposer(load_model(tiny["small"], dtype="float32", progress=False), 256, 4, 1024)
        for _ in range(2)
    )
    modes: dict[str, list[ForwardMode]] = {"rows": [], "extend": []}

    def behind(proposer: DraftModelProposer, name: str):
        proposer.read_prompt(_request("r", PROMPT))
        req = _request("r", PROMPT, max_new_tokens=64)
        # emitted since the prompt (more than a long draft's rows): caught up next
        req.output_ids.extend([5, 9, 11, 6, 8] * 5)
        forward = proposer.kv.model.forward
        proposer.kv.model.forward = lambda batch, pool: (  # type: ignore[method-assign]
            modes[name].append(batch.mode) or forward(batch, pool)
        )
        return req

    drafted = rows.propose(behind(rows, "rows"))
    monkeypatch.setattr(draft_model_kv, "DECODE_ROWS_MAX", 0)
    assert extend.propose(behind(extend, "extend")) == drafted and drafted
    assert modes["rows"][0] is ForwardMode.DECODE and modes["extend"][0] is ForwardMode.EXTEND
    assert rows.sequences["r"].tokens == extend.sequences["r"].tokens
    for proposer in (rows, extend):
        proposer.forget(set())
        proposer.check_invariants()


def test_a_cut_sequence_tables_the_slots_appended_after_the_cut():
    """A draft sequence's decode table (its slots as a tensor, copied only where new) follows a
    rewind: slots appended after a cut replace the cut ones, whatever their ids."""
    from sglite.runtime.scheduler.draft_model_state import DraftSequence
    from sglite.runtime.scheduler.speculation import DraftLength

    seq = DraftSequence(DraftLength(4), node=None)  # type: ignore[arg-type]
    seq.tokens, seq.slots = [5, 6, 7, 8], [10, 11, 12, 13]
    assert seq.slot_mirror.view(seq.slots).tolist() == [10, 11, 12, 13]
    seq.cut(2)  # a rejected draft's last two
    seq.tokens.extend([9, 4])
    seq.slots.extend([40, 41])
    assert seq.tokens == [5, 6, 9, 4]
    assert seq.slot_mirror.view(seq.slots).tolist() == [10, 11, 40, 41]


def test_a_draft_stops_where_the_target_would_likely_reject_it(tiny):
    """A draft grows while the draft model's probabilities, calibrated by the target's
    agreement so far, say its tokens will be kept often enough to pay (the break-even): after
    the target rejected tokens the draft model was sure of, one token per draft (the pass
    already run); once it has kept far more than the probabilities predicted, full drafts."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 256)
    for _ in range(40):
        proposer.calibration.record([0.99, 0.99], 0)
    req = _request("r", PROMPT * 2)
    first = proposer.propose(req)
    assert len(first) == 1
    probability = proposer.sequences["r"].probabilities[0]
    assert proposer.calibration.agreement(probability) < proposer.needed
    for _ in range(200):
        proposer.calibration.record([probability] * 4, 4)
    assert proposer.calibration.agreement(probability) > 0.99
    req.output_ids.append(first[0])
    assert len(proposer.propose(req)) == FIRST_DRAFT_TOKENS
    proposer.forget(set())
    proposer.check_invariants()


def test_a_draft_model_choosing_among_a_few_ids_leaves_outputs_unchanged(tmp_path):
    """A GGUF pair (a tiny Qwen2 with its tied Q8_0 head, drafting for itself) with a draft
    vocabulary of 48 of its 64 ids: the draft's tokens come from those, the added tokens and
    the prompt, and the outputs are the target's own."""
    import gguf
    from test_loader import make_hf_model, write_tiny_gguf

    hf = make_hf_model("qwen2", str(tmp_path / "hf"), tie_word_embeddings=True)
    q8_0, raw = gguf.GGMLQuantizationType.Q8_0, {}
    with torch.no_grad():  # Q8_0 projections: the model holds GGUF blocks, head included
        for name, param in hf.state_dict().items():
            if param.dim() == 2 and "embed" not in name and "lm_head" not in name:
                raw[name] = (gguf.quants.quantize(param.float().numpy(), q8_0), q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(raw[name][0], q8_0)))
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(hf, "qwen2", path, raw=raw)  # no tokenizer in it: both read tokenizer_path
    common = {"model_path": path, "tokenizer_path": str(tmp_path / "hf"), "dtype": "float32"}
    common["log_level"] = "error"
    plain = sglite.Engine(**common)
    try:
        want = plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        plain.shutdown()
    eng = sglite.Engine(
        **common,
        speculative_algorithm="draft",
        speculative_draft_model_path=path,
        speculative_draft_vocab_size=48,
        speculative_adaptive=False,
        speculative_draft_ngram=False,
    )
    try:
        got = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert _ids(got) == _ids(want)
        assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0
        assert eng.get_server_info()["speculative_draft"]["vocab_size"] == 48
        eng.check_invariants()
    finally:
        eng.shutdown()


def test_a_pass_for_fewer_drafts_needs_likelier_tokens():
    """A draft model's pass grows every drafting request for about one request's cost: the
    chance of being kept that a next token needs is the verification's part of the measured
    break-even plus the pass's seconds split among the drafts it grows. At batch 1 that is
    the measured break-even itself; at batch 4 a pass for one draft costs more than the
    token it may save (never pays), a pass for all four what the costs measured; a pass
    grows the likeliest drafts, as many as pay for their share."""
    from sglite.runtime.scheduler.draft_model_state import DraftPassCost, GrowingDraft

    unmeasured = DraftPassCost()
    assert unmeasured.needed(0.6, 0.02, 1, offered=1) == 0.6
    # batch 1: a pass per token; batch 4: four drafts per pass
    costs = DraftPassCost(pass_seconds=0.02, passes_per_token={1: 1.0, 4: 0.25})
    assert costs.needed(0.6, 0.05, 1, offered=1) == pytest.approx(0.6)
    assert costs.needed(0.6, 0.02, 4, offered=4) == pytest.approx(0.6)
    assert costs.needed(0.6, 0.02, 2, offered=4) == pytest.approx(0.85)
    assert costs.needed(0.6, 0.02, 1, offered=4) == pytest.approx(1.35)
    assert costs.needed(0.6, None, 1, offered=4) == 0.6  # what a token saves not yet measured
    assert costs.needed(0.6, 0.02, 1, offered=3) == 0.6  # no proposal for 3 measured yet

    def grown(*wholes: float) -> list[str]:
        drafts = [GrowingDraft(f"g{i}", None, 4, [], False, whole=w) for i, w in enumerate(wholes)]  # type: ignore[arg-type]
        return [d.rid for d in costs.worth_a_pass(drafts, 0.6, 0.02, offered=4)]

    assert grown(0.9, 0.9, 0.9, 0.9) == ["g0", "g1", "g2", "g3"]
    assert grown(0.4, 0.95, 0.9, 0.4) == ["g1", "g2"]
    assert grown(0.99, 0.3, 0.3, 0.3) == []  # one alone would not pay for its pass
    costs.add_pass(0.04)
    costs.add_draft(offered=4, passes=4, tokens=4, drafts=4)
    assert 0.02 < costs.pass_seconds < 0.04 and 0.25 < costs.passes_per_token[4] < 1.0
    assert costs.passes_per_token[1] == 1.0


def test_a_request_does_not_start_a_draft_alone_where_a_pass_for_it_cannot_pay(tiny):
    """Where a draft model's pass costs more than a plain step's share of one request (batch
    4), a request that alone would start a draft waits (its catch-up deferred) without a pass
    of the draft model, while four starting together draft."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_model_state import DraftPassCost

    proposer = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 1024)
    for _ in range(30):  # drafts kept 3 in 4 where 0.5 pays: drafting pays
        proposer.record(_request("x", PROMPT), 4, 3, BreakEvens(0.5, 0.5, 0.02))
    proposer.pass_cost = DraftPassCost(pass_seconds=0.02, passes_per_token={1: 0.25, 4: 0.25})
    lone = _request("lone", PROMPT)
    proposer.read_prompt(lone)
    lone.output_ids.append(5)
    passes = proposer.kv.forward_passes
    assert proposer.propose_many([lone]) == {}
    assert proposer.kv.forward_passes == passes
    reqs = [_request(f"r{i}", PROMPT[i:]) for i in range(4)]
    for req in reqs:
        proposer.read_prompt(req)
        req.output_ids.append(5)
    assert len(proposer.propose_many(reqs)) == 4
    for req in [*reqs, lone]:  # the target's next token; the lone request two tokens behind
        req.output_ids.append(6)
    assert len(proposer.propose_many([*reqs, lone])) == 5  # it drafts with the others
    proposer.forget(set())
    proposer.check_invariants()


def test_the_draft_model_takes_the_requests_whose_ngram_match_it_beats(tiny):
    """With n-gram drafts first, a request whose only match is short (a record's field names
    repeat, their values do not) is drafted by the draft model once its tokens are kept more
    often above what they cost; a long match that is kept more goes on being copied. A draft
    model passed over ages its tally until it is tried again (`expected_share` 1)."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_tally import MIN_EVIDENCE_TOKENS
    from sglite.runtime.scheduler.ngram import NgramProposer
    from sglite.runtime.scheduler.speculators import NgramBeforeDraft

    model = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 1024)
    ngram = NgramProposer(context_len=256, num_draft_tokens=4, min_match=1, max_match=4)
    both = NgramBeforeDraft(ngram, model)
    allow_all = lambda source: EVERY_REQUEST  # noqa: E731
    short = _request("short", [*PROMPT, PROMPT[3]])  # only the last token was seen before
    long = _request("long", [*PROMPT, *PROMPT[:5]])
    for _ in range(30):
        ngram.kinds["weak"].record(4, 1, 0.2)  # short matches: 1 token in 4 kept
        ngram.kinds["strong"].record(4, 4, 0.2)  # long ones: all kept
        model.record(short, 4, 3, BreakEvens(0.3, 0.3, 0.02))  # the draft model: 3 in 4
    proposals = both.speculate([short, long], allow_all)
    assert proposals["short"].source == "draft" and both.last["short"] is model
    first = PROMPT[5 : 5 + FIRST_DRAFT_TOKENS]
    assert proposals["long"].source == "ngram" and proposals["long"].tokens == first
    assert both.proposals == {"ngram": 1, "draft": 1}

    share, evidence = model.acceptance.share, model.acceptance.drafted
    for _ in range(60):  # passed over for the long match, step after step
        both.speculate([long], allow_all)
    assert model.acceptance.share == pytest.approx(share)
    assert model.acceptance.drafted < min(evidence, MIN_EVIDENCE_TOKENS)
    assert model.acceptance.expected_share == 1.0

    for _ in range(60):  # drafts that do not cover their cost: n-gram drafts only
        model.record(short, 4, 0, BreakEvens(0.5, 0.5, 0.02))
    again = _request("again", [*PROMPT, PROMPT[3]])
    assert both.speculate([again], allow_all)["again"].source == "ngram"
    model.forget(set())
    model.check_invariants()


def test_an_ngram_draft_passed_over_grows_where_the_target_wrote_it(tiny):
    """A copy the draft model took first: its n-gram draft, passed over at its first length,
    grows as if kept where the target then wrote it (else it would stay that short, its likely
    gain below the draft model's longer drafts' for good); where the target wrote other
    tokens it does not."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.ngram import NgramProposer
    from sglite.runtime.scheduler.speculation import UNGROUPED_ROWS
    from sglite.runtime.scheduler.speculators import NgramBeforeDraft

    model = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 15, 1024)
    ngram = NgramProposer(context_len=256, num_draft_tokens=15, min_match=1, max_match=4)
    both = NgramBeforeDraft(ngram, model)
    allow_all = lambda source: EVERY_REQUEST  # noqa: E731
    for _ in range(30):  # the draft model's drafts kept whole, long matches' half
        model.record(_request("x", PROMPT), 4, 4, BreakEvens(0.3, 0.3, 0.02))
        ngram.kinds["strong"].record(4, 2, 0.45)
    passed = PROMPT[5 : 5 + FIRST_DRAFT_TOKENS]  # the n-gram draft at its first length
    for rid, written in (("copy", passed), ("other", [3] * FIRST_DRAFT_TOKENS)):
        req = _request(rid, [*PROMPT, *PROMPT[:5]])
        proposal = both.speculate([req], allow_all)[rid]
        assert proposal.source == "draft" and both.passed[rid] == passed
        req.output_ids.extend(written)  # the draft model's tokens kept but one, then its own
        kept = FIRST_DRAFT_TOKENS - 1
        both.record(req, len(proposal.tokens), kept, BreakEvens(0.3, 0.3, 0.02))
    assert ngram.states["copy"].length.current == UNGROUPED_ROWS.grown(FIRST_DRAFT_TOKENS, 15)
    assert ngram.states["other"].length.current == FIRST_DRAFT_TOKENS
    model.forget(set())
    model.check_invariants()


def test_a_draft_model_that_does_not_pay_probes_a_request_its_ngram_match_serves_poorly(tiny):
    """While the draft model's drafts do not pay, a request whose n-gram match is weak is still
    offered to it, for the rare probe (`KindAcceptance.admit`): when one falls due, the next
    new prompt is read as the target prefills it (not only one in PROMPT_READ_EVERY_UNPAID),
    so that the probe runs on that request in step rather than never; not where a lone draft
    cannot pay at all."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import PROMPT_READ_EVERY_UNPAID, DraftModelProposer
    from sglite.runtime.scheduler.draft_model_state import DraftPassCost
    from sglite.runtime.scheduler.draft_tally import KIND_PROBE_EVERY
    from sglite.runtime.scheduler.ngram import NgramProposer
    from sglite.runtime.scheduler.speculators import NgramBeforeDraft

    model = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 1024)
    ngram = NgramProposer(context_len=256, num_draft_tokens=4, min_match=1, max_match=4)
    both = NgramBeforeDraft(ngram, model)
    for _ in range(30):
        ngram.kinds["weak"].record(4, 1, 0.2)  # short matches: 1 token in 4 kept
    for _ in range(6):  # drafts of 4 that kept nothing, where 90% was needed
        model.record(_request("x", PROMPT), 4, 0, BreakEvens(0.9, 0.9))
    assert KIND_PROBE_EVERY == PROMPT_READ_EVERY_UNPAID == 8  # the steps below count on it
    # a catch-up of a prompt at 10 ms a token, 30 ms saved per token kept: a request's last 14
    # tokens do not repay reading its prompt for a probe
    model.pass_cost.catch_up_seconds, model.saved_seconds = 0.010, 0.030
    sources, prompts_read = [], []
    for i in range(5):  # each matches only its last token, seen once in the prompt
        req = _request(f"r{i}", [*PROMPT, 60])
        passes = model.kv.forward_passes
        both.read_prompt(req)  # as the target prefills it
        prompts_read.append(model.kv.forward_passes > passes)
        for token in (33, 21):
            req.output_ids.append(token)
            proposals = both.speculate([req], lambda source: EVERY_REQUEST)
            sources.append(proposals[req.rid].source if req.rid in proposals else None)
            if sources[-1] == "draft":
                break
    # 8 refusals: the 8th due, but r3's prompt unread (too far behind); r4's read for it. (A
    # request's n-gram draft that its next token showed wrong is not proposed again.)
    assert sources == ["ngram", None] * 4 + ["draft"]
    assert prompts_read == [False, False, False, False, True]
    # where a lone draft cannot pay (a 20 ms pass against 20 ms saved per token: batch 4), a
    # due probe has no prompt read for it
    model.pass_cost = DraftPassCost(pass_seconds=0.02, passes_per_token={1: 0.25})
    model.record(req, 4, 0, BreakEvens(0.9, 0.9, 0.02))
    model.acceptance.refused = model.acceptance.probe_gap  # a probe due
    passes = model.kv.forward_passes
    both.read_prompt(_request("late", [*PROMPT, 60]))
    assert model.kv.forward_passes == passes
    # where a lone draft can pay again (50 ms saved per token), a due probe has one prompt read
    # for it, not each of a batch's prompts arriving together
    model.record(req, 4, 0, BreakEvens(0.3, 0.3, 0.05))
    model.acceptance.refused = model.acceptance.probe_gap  # a probe due
    reads = []
    for name, tokens in (("a", [7, 8]), ("b", [9, 10])):
        passes = model.kv.forward_passes
        both.read_prompt(_request(name, [*PROMPT, *tokens]))
        reads.append(model.kv.forward_passes > passes)
    assert reads == [True, False]
    model.forget({"b"})  # "a" ended before the probe came: the next due probe reads again
    passes = model.kv.forward_passes
    both.read_prompt(_request("c", [*PROMPT, 11, 12]))
    assert model.kv.forward_passes > passes
    model.forget(set())
    model.check_invariants()


def test_a_due_probe_waits_for_a_step_where_a_draft_kept_whole_would_pay(tiny):
    """A probe finds at most drafts kept whole: where even those cannot pay for the pass and
    rows one request's draft costs (a batch of four on a CPU, as the step prices it), a due
    probe waits, and comes at the first step where they could."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_model_state import DraftPassCost

    model = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 1024)
    req = _request("a", PROMPT)
    assert model.propose(req)
    for _ in range(6):  # drafts of 4 that kept nothing, where 90% was needed
        model.record(req, 4, 0, BreakEvens(0.9, 0.9, 0.05))
    model.forget(set())
    model.pass_cost = DraftPassCost(pass_seconds=0.02, passes_per_token={1: 0.25})
    model.acceptance.refused = model.acceptance.probe_gap  # a probe due
    fresh = _request("b", PROMPT[:3])  # a short prompt: in step at once
    fresh.output_ids.append(PROMPT[3])
    model.price(lambda source: BreakEvens(0.9, 0.9, 0.02))  # 20 ms saved a token: batch 4
    assert model.gain(1) <= 0 and model.propose(fresh) == []
    assert model.acceptance.probe_due  # still due
    fresh.output_ids.append(PROMPT[4])
    model.price(lambda source: BreakEvens(0.3, 0.3, 0.05))  # 50 ms: a lone request
    assert model.gain(1) > 0 and model.propose(fresh)  # the probe
    assert model.acceptance.refused == 0
    model.forget(set())
    model.check_invariants()


def test_in_a_batch_where_a_lone_draft_cannot_pay_ngram_matches_keep_their_requests(tiny):
    """At batch 4 a draft model's pass costs more than a plain step's share of one request: a
    request whose short match the draft model would beat at batch 1 keeps its n-gram draft
    there (no lone draft of the draft model pays)."""
    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer
    from sglite.runtime.scheduler.draft_model_state import DraftPassCost
    from sglite.runtime.scheduler.ngram import NgramProposer
    from sglite.runtime.scheduler.speculators import NgramBeforeDraft

    model = DraftModelProposer(load_model(tiny["small"], progress=False), 256, 4, 1024)
    ngram = NgramProposer(context_len=256, num_draft_tokens=4, min_match=1, max_match=4)
    both = NgramBeforeDraft(ngram, model)
    for _ in range(30):  # at batch 1, an accepted token saves 50 ms; 3 drafted in 4 kept
        ngram.kinds["weak"].record(4, 1, 0.2)
        model.record(_request("x", PROMPT), 4, 3, BreakEvens(0.3, 0.3, 0.05))
    # a pass: 20 ms, a quarter of one per drafted token
    model.pass_cost = DraftPassCost(pass_seconds=0.02, passes_per_token={1: 0.25, 4: 0.25})

    def sources(count: int, tag: str) -> list[str]:
        reqs = [_request(f"{tag}{i}", PROMPT) for i in range(count)]
        for req in reqs:
            both.read_prompt(req)
            req.output_ids.append(33)  # PROMPT has 33 once: a one-token match
        proposals = both.speculate(reqs, lambda source: EVERY_REQUEST)
        return [proposals[req.rid].source for req in reqs]

    assert sources(1, "one") == ["draft"]
    model.record(_request("x", PROMPT), 4, 3, BreakEvens(0.3, 0.3, 0.02))  # at batch 4: 20 ms
    assert sources(4, "four") == ["ngram"] * 4
    model.forget(set())
    model.check_invariants()
