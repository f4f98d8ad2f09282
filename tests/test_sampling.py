"""Sampling parameters and the batched sampler, on synthetic logits with seeded statistics."""

from __future__ import annotations

import math

import pytest
import torch

from sglite.runtime.sampling.params import SamplingParams
from sglite.runtime.sampling.request_state import SamplingInfo
from sglite.runtime.sampling.sampler import Sampler

EOS = 2


def info(
    prompt: list[int] | None = None, output: list[int] | None = None, **params
) -> SamplingInfo:
    """A SamplingInfo for `params`, with the given prompt and already generated tokens."""
    inf = SamplingInfo.create(SamplingParams.from_dict(params), prompt or [])
    for t in output or []:
        inf.on_token(t)
    return inf


def draw(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    """n independent draws from one row of logits (one batch of n identical rows)."""
    vocab = logits.shape[-1]
    sampler = Sampler(vocab)
    infos = [info(**params) for _ in range(n)]
    out = sampler.sample(logits.expand(n, vocab).contiguous(), infos, [EOS], None, [False] * n)
    return torch.tensor(out.next_token_ids)


def from_probs(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is `probs` (padded to a vocabulary of 50 with ~zero mass)."""
    p = torch.full((50,), 1e-12)
    p[: len(probs)] = torch.tensor(probs)
    return torch.log(p)


def entropy(tokens: torch.Tensor, vocab: int) -> float:
    """Entropy (nats) of the empirical distribution of `tokens`."""
    freq = torch.bincount(tokens, minlength=vocab).double() / len(tokens)
    nz = freq[freq > 0]
    return float(-(nz * nz.log()).sum())


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """SGLang's definition via a full sort: temperature, then top-p, top-k, min-p masks."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    ps, idx = probs.sort(descending=True)
    keep = torch.ones_like(ps, dtype=torch.bool)
    if p.top_p < 1:
        keep &= (ps.cumsum(-1) - ps) < p.top_p
    if p.top_k > 0:
        keep &= torch.arange(len(ps)) < p.top_k
    keep &= ps >= p.min_p * ps[0]
    out = torch.zeros_like(probs)
    out[idx[keep]] = ps[keep]
    return out / out.sum()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# ---------------------------------------------------------------------------- SamplingParams


def test_defaults_match_sglang():
    p = SamplingParams.from_dict(None)
    assert p == SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.stop_regex == []
    assert p.repetition_penalty == 1.0 and p.seed is None and not p.is_greedy


def test_none_and_empty_lists_mean_unset():
    # What SGLang's frontend sends for a plain gen() call: every field, defaults included.
    sent = {
        "max_new_tokens": 16,
        "min_new_tokens": None,
        "n": None,
        "stop": [],
        "stop_token_ids": None,
        "stop_regex": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "frequency_penalty": None,
        "presence_penalty": None,
        "ignore_eos": None,
        "regex": None,
        "json_schema": None,
    }
    p = SamplingParams.from_dict(sent)
    assert p == SamplingParams(max_new_tokens=16)
    assert SamplingParams.from_dict({"stop": (), "stop_token_ids": []}).stop == []


def test_normalisation():
    p = SamplingParams.from_dict({"stop": "\n", "stop_regex": r"\d+", "top_k": 0, "seed": 7})
    assert p.stop == ["\n"] and p.stop_regex == [r"\d+"] and p.top_k == -1 and p.seed == 7
    assert SamplingParams.from_dict({"max_new_tokens": 32.0}).max_new_tokens == 32
    assert SamplingParams.from_dict({"temperature": 0}).is_greedy
    assert SamplingParams.from_dict({"top_k": 1}).is_greedy
    schema = {"type": "object"}
    assert SamplingParams.from_dict({"json_schema": schema}).json_schema == '{"type": "object"}'


def test_to_dict_round_trips():
    p = SamplingParams.from_dict(
        {"stop": ["a", "b"], "stop_token_ids": [5], "temperature": 0.7, "top_p": 0.9, "seed": 3}
    )
    d = p.to_dict()
    assert d["stop"] == ["a", "b"] and d["temperature"] == 0.7
    assert SamplingParams.from_dict(d) == p
    d["stop"].append("c")  # a copy, not the params' own list
    assert p.stop == ["a", "b"]


def test_unknown_key_is_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"foo": 1})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", "10"),
        ("max_new_tokens", True),
        ("max_new_tokens", 1.5),
        ("min_new_tokens", -1),
        ("min_new_tokens", 500),  # more than max_new_tokens (128)
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 3),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [1, 2]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["x"]),
        ("stop_regex", "(unclosed"),
        ("stop_regex", "a*"),  # matches the empty string: would stop at once
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("regex", 5),
        ("json_schema", "{not json"),
        ("seed", "abc"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_range_is_in_the_message():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams.from_dict({"top_p": 2})


def test_at_most_one_constraint():
    with pytest.raises(ValueError, match="regex.*json_schema"):
        SamplingParams.from_dict({"regex": "a+", "json_schema": "{}"})
    with pytest.raises(ValueError, match="ebnf"):
        SamplingParams.from_dict({"json_schema": "{}", "ebnf": "root ::= 'a'"})


def test_not_a_dict():
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict(["temperature", 1])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- choosing tokens


def test_greedy_is_argmax():
    logits = torch.randn(8, 1000)
    out = Sampler(1000).sample(logits, [info(temperature=0) for _ in range(8)], [EOS], [0] * 8)
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 1000)
    infos = [info(temperature=0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(6)]
    out = Sampler(1000).sample(logits, infos, [EOS], [0] * 6)
    argmax = logits.argmax(-1).tolist()
    assert [out.next_token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_sample_leaves_the_logits_untouched():
    logits = torch.randn(3, 100)
    before = logits.clone()
    infos = [info(output=[5, 5], frequency_penalty=1.0, repetition_penalty=1.5, min_new_tokens=9)]
    infos += [info(temperature=0.7, top_p=0.8), info(temperature=0)]
    Sampler(100).sample(logits, infos, [EOS], [2, 0, 0])
    assert torch.equal(logits, before)


def test_temperature_moves_entropy():
    logits = torch.randn(100) * 2
    h = [entropy(draw(logits, 4000, temperature=t), 100) for t in (0.3, 1.0, 3.0)]
    assert h[0] < h[1] - 0.3 and h[1] < h[2] - 0.3


def test_plain_sampling_matches_softmax():
    logits = torch.randn(40)
    tokens = draw(logits, 20000, temperature=0.8)
    emp = torch.bincount(tokens, minlength=40).double() / len(tokens)
    assert 0.5 * (emp - torch.softmax(logits.double() / 0.8, -1)).abs().sum() < 0.03


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(1000)
    tokens = draw(logits, 3000, top_k=5)
    best = set(logits.topk(5).indices.tolist())
    assert set(tokens.tolist()) == best


def test_top_p_keeps_the_smallest_nucleus():
    logits = from_probs([0.5, 0.3, 0.15, 0.05])
    assert set(draw(logits, 2000, top_p=0.8).tolist()) == {0, 1}
    assert set(draw(logits, 2000, top_p=0.81).tolist()) == {0, 1, 2}
    assert set(draw(logits, 2000, top_p=0.3).tolist()) == {0}


def test_min_p_drops_tokens_below_min_p_times_max():
    logits = from_probs([0.6, 0.3, 0.07, 0.03])
    assert set(draw(logits, 2000, min_p=0.1).tolist()) == {0, 1, 2}  # cut at 0.06
    assert set(draw(logits, 2000, min_p=0.2).tolist()) == {0, 1}  # cut at 0.12


def test_rows_keep_their_own_filters_in_one_batch():
    logits = from_probs([0.6, 0.3, 0.07, 0.03])
    n = 1500
    infos = [info(min_p=0.1) for _ in range(n)] + [info(min_p=0.2) for _ in range(n)]
    infos += [info(top_p=0.8) for _ in range(n)] + [info(top_k=3) for _ in range(n)]
    out = Sampler(50).sample(logits.expand(4 * n, 50), infos, [EOS], None, [False] * 4 * n)
    tokens = torch.tensor(out.next_token_ids).view(4, n)
    assert [set(row.tolist()) for row in tokens] == [{0, 1, 2}, {0, 1}, {0, 1}, {0, 1, 2}]


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 0.9, "temperature": 0.7},
        {"top_k": 7, "top_p": 0.6},
        {"top_k": 20, "min_p": 0.1},
        {"top_p": 0.95, "min_p": 0.05, "temperature": 1.5},
    ],
)
def test_filtered_distribution_matches_the_reference(params):
    logits = torch.randn(60) * 1.5
    tokens = draw(logits, 20000, **params)
    ref = reference_probs(logits, SamplingParams.from_dict(params))
    assert (ref[tokens] > 0).all()
    emp = torch.bincount(tokens, minlength=60).double() / len(tokens)
    assert 0.5 * (emp - ref).abs().sum() < 0.03


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 0.9},  # a nucleus of thousands: the bucketed path
        {"top_p": 0.5, "temperature": 0.5},  # within the first 64 candidates
        {"top_p": 0.7, "temperature": 0.6},  # a retry with more candidates
        {"top_k": 600},  # top-k past the first candidates
        {"top_k": 5000, "top_p": 0.95},  # top-k and top-p through the bucketed path
    ],
)
def test_wide_cuts_on_a_large_vocabulary(params):
    vocab = 16384
    logits = torch.randn(vocab) * 2
    p = SamplingParams.from_dict(params)
    ref = reference_probs(logits, p)
    tokens = draw(logits, 64, **params)
    assert (ref[tokens] > 0).all()
    # The kept set is exactly the reference one, not a subset: the reference's best half
    # (by probability) should receive about its own mass of the draws.
    order = ref.argsort(descending=True)[: int((ref > 0).sum()) // 2]
    hits = torch.isin(tokens, order).double().mean()
    assert abs(float(hits) - float(ref[order].sum())) < 0.2


def test_frequency_and_presence_penalties_lower_seen_tokens():
    logits = torch.zeros(20)
    base = draw(logits, 4000)
    freq = draw(logits, 4000, frequency_penalty=1.0, output=[3, 3, 3])
    pres = draw(logits, 4000, presence_penalty=1.5, output=[3, 7])
    assert (base == 3).float().mean() > 0.03
    assert (freq == 3).float().mean() < 0.005  # e^-3 relative weight
    assert (pres == 3).float().mean() < 0.02 and (pres == 7).float().mean() < 0.02
    # Negative values encourage repetition instead.
    more = draw(logits, 4000, presence_penalty=-2.0, output=[4])
    assert (more == 4).float().mean() > 0.2


def test_frequency_penalty_scales_with_count_and_ignores_the_prompt():
    logits = torch.tensor([1.0, 0.0, -5.0, -5.0])
    sampler = Sampler(4)
    # Prompt tokens do not count for frequency/presence penalties (OpenAI semantics).
    a = info(prompt=[0, 0, 0], temperature=0, frequency_penalty=2.0)
    assert sampler.sample(logits[None], [a], [], [0]).next_token_ids == [0]
    b = info(temperature=0, frequency_penalty=0.6)
    tokens = []
    for _ in range(3):
        tok = sampler.sample(logits[None], [b], [], [0]).next_token_ids[0]
        tokens.append(tok)
        b.on_token(tok)  # the cached counts update incrementally
    assert tokens == [0, 0, 1]  # 1 - 0.6 * 2 < 0 only once token 0 occurred twice


def test_repetition_penalty_uses_prompt_tokens():
    logits = torch.tensor([2.0, 1.5, -1.0, -1.2])
    sampler = Sampler(4)
    plain = info(temperature=0, prompt=[0])
    assert sampler.sample(logits[None], [plain], [], [0]).next_token_ids == [0]
    pen = info(temperature=0, prompt=[0], repetition_penalty=1.5)  # 2.0 / 1.5 < 1.5
    assert sampler.sample(logits[None], [pen], [], [0]).next_token_ids == [1]
    # Negative logits are multiplied, so they also become less likely.
    neg = info(temperature=0, output=[2], repetition_penalty=1.5)  # -1.0 * 1.5 < -1.2
    neg_logits = torch.tensor([-5.0, -5.0, -1.0, -1.2])
    assert sampler.sample(neg_logits[None], [neg], [], [0]).next_token_ids == [3]
    # And statistically: a repeated token is drawn less often.
    flat = torch.full((10,), 2.0)
    seen = draw(flat, 4000, repetition_penalty=2.0, prompt=[5])
    assert (seen == 5).float().mean() < 0.06  # 1/10 without the penalty, ~0.04 with it


def test_penalties_in_a_mixed_batch_only_touch_their_rows():
    logits = torch.tensor([[1.0, 0.9, 0.0]] * 3)
    infos = [
        info(temperature=0, output=[0], presence_penalty=1.0),
        info(temperature=0, output=[0]),
        info(temperature=0, prompt=[0], repetition_penalty=2.0),
    ]
    assert Sampler(3).sample(logits, infos, [], [0] * 3).next_token_ids == [1, 0, 1]


def test_min_new_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.tensor([0.0, 1.0, 5.0, 4.0, 0.5])  # EOS (2) is the favourite, then 3
    sampler = Sampler(5)
    r = info(temperature=0, min_new_tokens=2, stop_token_ids=[3])
    first = sampler.sample(logits[None], [r], [EOS], [0]).next_token_ids[0]
    assert first == 1  # neither EOS nor the stop token
    r.on_token(first)
    assert sampler.sample(logits[None], [r], [EOS], [0]).next_token_ids == [1]
    r.on_token(1)
    assert sampler.sample(logits[None], [r], [EOS], [0]).next_token_ids == [EOS]
    # Sampling never draws a blocked token either.
    tokens = draw(torch.tensor([0.0, 0.0, 3.0, 0.0]), 2000, min_new_tokens=1)
    assert EOS not in tokens.tolist()


def test_same_seed_same_tokens_whatever_the_neighbours():
    vocab = 3000
    torch.manual_seed(0)
    steps = [torch.randn(vocab) * 2 for _ in range(12)]
    for params in ({"top_p": 0.9, "temperature": 0.8}, {"temperature": 1.2}, {"top_k": 30}):
        alone = _seeded_run(steps, params, neighbours=0)
        crowded = _seeded_run(steps, params, neighbours=7)
        assert alone == crowded
        assert alone != _seeded_run(steps, {**params, "seed": 43}, neighbours=0)


def _seeded_run(steps: list[torch.Tensor], params: dict, neighbours: int) -> list[int]:
    """Tokens of a request seeded with 42 (unless params say otherwise) over the given steps,
    batched with `neighbours` other requests of assorted params and seeds."""
    vocab = steps[0].shape[0]
    sampler = Sampler(vocab)
    me = info(**{"seed": 42, **params})
    others = [
        info(top_k=200, seed=7),  # changes the batch's candidate count
        info(temperature=0.5),
        info(temperature=0),
        info(top_p=0.3, seed=99),
        info(frequency_penalty=1.0),
        info(min_p=0.2),
        info(top_k=3000),
    ][:neighbours]
    tokens = []
    for logits in steps:
        rows = [torch.randn(vocab) for _ in others]
        batch = torch.stack([*rows[:3], logits, *rows[3:]])
        infos = [*others[:3], me, *others[3:]]
        out = sampler.sample(batch, infos, [EOS], [0] * len(infos))
        pos = min(3, len(others))
        tokens.append(out.next_token_ids[pos])
        for inf, tok in zip(infos, out.next_token_ids, strict=True):
            inf.on_token(tok)
    return tokens


def test_different_seeds_differ_and_unseeded_rows_vary():
    logits = torch.zeros(1, 1000)
    sampler = Sampler(1000)
    a = [sampler.sample(logits, [info(seed=s)], [], [0]).next_token_ids[0] for s in range(20)]
    assert len(set(a)) > 10
    b = [sampler.sample(logits, [info(seed=5)], [], [0]).next_token_ids[0] for _ in range(5)]
    assert len(set(b)) == 1  # a fresh request with the same seed starts the same way


def test_reported_logprobs_are_log_softmax_of_the_logits():
    logits = torch.randn(4, 300) * 3
    infos = [info(), info(temperature=0.5, top_p=0.5), info(temperature=0), info(top_k=3)]
    out = Sampler(300).sample(logits, infos, [EOS], [0, 5, 2, 0])
    lsm = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.next_token_ids):
        assert out.logprobs[i] == pytest.approx(float(lsm[i, tok]), abs=1e-5)
    assert out.top_logprobs[0] is None and out.top_logprobs[3] is None
    best = lsm[1].topk(5)
    assert [t for _, t in out.top_logprobs[1]] == best.indices.tolist()
    assert [v for v, _ in out.top_logprobs[1]] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert len(out.top_logprobs[2]) == 2


def test_logprobs_follow_penalties_and_masking():
    logits = torch.randn(1, 50)
    r = info(output=[4, 4], frequency_penalty=0.5, presence_penalty=0.25, min_new_tokens=5)
    out = Sampler(50).sample(logits, [r], [EOS], [3])
    expected = logits[0].clone()
    expected[4] -= 0.5 * 2 + 0.25
    expected[EOS] = float("-inf")
    lsm = torch.log_softmax(expected, -1)
    assert out.logprobs[0] == pytest.approx(float(lsm[out.next_token_ids[0]]), abs=1e-5)
    assert EOS not in [t for _, t in out.top_logprobs[0]]


def test_logprobs_can_be_skipped_per_row():
    logits = torch.randn(2, 30)
    out = Sampler(30).sample(logits, [info(), info()], [EOS], [0, 0], return_logprobs=[False, True])
    assert math.isnan(out.logprobs[0]) and not math.isnan(out.logprobs[1])


def test_logprobs_of_input_tokens():
    logits = torch.randn(5, 80)
    targets = torch.tensor([3, 1, 4, 1, 5])
    values, tops = Sampler(80).logprobs_of(logits, targets, 0)
    lsm = torch.log_softmax(logits, -1)
    assert values == pytest.approx(lsm[torch.arange(5), targets].tolist(), abs=1e-5)
    assert tops is None
    values, tops = Sampler(80).logprobs_of(logits.to(torch.bfloat16), targets, 3)
    assert len(tops) == 5 and all(len(t) == 3 for t in tops)
    assert tops[0][0][0] >= tops[0][1][0] >= tops[0][2][0]
    assert Sampler(80).logprobs_of(logits[:0], targets[:0], 2) == ([], [])


def test_empty_batch():
    out = Sampler(10).sample(torch.empty(0, 10), [], [EOS], [])
    assert out.next_token_ids == [] and out.logprobs == [] and out.top_logprobs == []


def test_release_drops_cached_state():
    r = info(output=[1, 2, 2], frequency_penalty=1.0, repetition_penalty=1.2, prompt=[7])
    Sampler(10).sample(torch.zeros(1, 10), [r], [EOS], [0])
    assert r.output_tokens().counts.tolist() == [1.0, 2.0]
    assert sorted(r.seen_tokens().ids.tolist()) == [1, 2, 7]
    r.release()
    r.on_token(9)  # no tables to update; rebuilt from the history if needed again
    assert sorted(r.output_tokens().ids.tolist()) == [1, 2, 9]


def test_prompt_ids_beyond_the_logits_are_ignored_by_penalties():
    r = info(prompt=[1, 500], output=[3, 700], repetition_penalty=1.3, frequency_penalty=0.5)
    out = Sampler(10).sample(torch.ones(1, 10), [r], [EOS], [0])
    assert 0 <= out.next_token_ids[0] < 10


@pytest.mark.parametrize(
    "params",
    [{}, {"top_p": 0.9}, {"top_k": 2000}, {"top_k": 40, "min_p": 0.01}, {"temperature": 0}],
)
def test_masked_tokens_are_never_drawn(params):
    # A grammar mask leaves a handful of allowed tokens; everything else is -inf.
    logits = torch.full((5000,), float("-inf"))
    allowed = [7, 1234, 4999]
    logits[allowed] = torch.tensor([0.5, 0.0, -0.5])
    tokens = draw(logits, 300, **params)
    assert set(tokens.tolist()) <= set(allowed)
    if params.get("temperature", 1) != 0:
        assert set(tokens.tolist()) == set(allowed)


@pytest.mark.parametrize(
    "params", [{"temperature": 0}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.9}]
)
def test_nan_or_fully_masked_rows_are_reported_not_sampled(params):
    """A broken row is named in `invalid_rows`; the healthy rows of the batch sample as usual."""
    vocab = 4096
    logits = torch.randn(4, vocab)
    logits[0, 17] = float("nan")
    logits[2] = float("-inf")
    good = torch.randn(vocab)
    good[5] = 40.0  # one token dominates, so even tempered rows pick it
    logits[1] = logits[3] = good
    out = Sampler(vocab).sample(logits, [info(**params) for _ in range(4)], [EOS])
    assert out.invalid_rows == [0, 2]
    assert out.next_token_ids[1] == out.next_token_ids[3] == 5
    assert math.isfinite(out.logprobs[1])
