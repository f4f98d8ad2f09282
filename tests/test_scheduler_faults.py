"""A request whose own generation raises ends with an error; the rest of its batch goes on.

Runs the real Scheduler in this process on the default model, with a fault injected into one
request's grammar matcher (the component that runs per request inside a batched step).
"""

from __future__ import annotations

from typing import Any

import pytest

from sglite.runtime.scheduler.io import GenerateInput, RequestOutput
from sglite.runtime.scheduler.request_table import ReqStatus
from sglite.runtime.server_args import ServerArgs

JSON_REGEX = r'\{"name": "[A-Za-z ]{1,20}", "age": [0-9]{1,2}\}'


@pytest.fixture(scope="module")
def scheduler():
    import torch

    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.scheduler import Scheduler

    torch.manual_seed(0)
    loaded = load_model(None, "float32", progress=False)
    return Scheduler(ServerArgs(dtype="float32", max_total_tokens=4096), loaded)


class FaultyMatcher:
    """Delegates to a real matcher but raises in `method` once it has been called `after` times."""

    def __init__(self, inner: Any, method: str, after: int) -> None:
        self.inner = inner
        self.method = method
        self.calls = 0
        self.after = after

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError(f"injected fault in {name}")
            return attr(*args, **kwargs)

        return wrapped


def _requests(tok: Any) -> list[GenerateInput]:
    greedy = {"max_new_tokens": 24, "temperature": 0}
    ids = lambda text: tok.encode(text)  # noqa: E731
    return [
        GenerateInput("faulty", ids("A person as JSON:"), {**greedy, "regex": JSON_REGEX}),
        GenerateInput("plain", ids("The capital of France is"), greedy),
        GenerateInput("json", ids("Another person as JSON:"), {**greedy, "regex": JSON_REGEX}),
    ]


def _run(scheduler: Any, inputs: list[GenerateInput], fault: str | None) -> dict[str, dict]:
    """Run `inputs` together to the end; inject `fault` into request "faulty" once it runs."""
    for inp in inputs:
        scheduler.add_request(inp)
    results: dict[str, dict] = {inp.rid: {"ids": [], "reason": None} for inp in inputs}
    for _ in range(500):
        if not scheduler.has_work:
            break
        outs: list[RequestOutput] = scheduler.step()
        for req in scheduler.table.with_status(ReqStatus.RUNNING):
            if fault and req.rid == "faulty" and not isinstance(req.grammar, FaultyMatcher):
                req.grammar = FaultyMatcher(req.grammar, fault, after=1)
        for out in outs:
            results[out.rid]["ids"] += out.new_token_ids
            if out.finish_reason is not None:
                results[out.rid]["reason"] = out.finish_reason
    assert not scheduler.has_work, "the scheduler did not finish"
    return results


@pytest.mark.parametrize("fault", ["accept_token", "fill_bitmask", "forced_tokens"])
def test_one_failing_request_does_not_fail_its_batch(scheduler, fault):
    tok = scheduler.tokenizer.hf
    alone = _run(scheduler, _requests(tok)[1:], fault=None)
    together = _run(scheduler, _requests(tok), fault=fault)
    reason = together["faulty"]["reason"]
    assert reason["type"] == "abort", reason
    assert "internal error" in reason["message"] and "injected fault" in reason["message"]
    for rid in ("plain", "json"):
        assert together[rid]["reason"]["type"] in ("stop", "length"), together[rid]
        assert together[rid]["ids"] == alone[rid]["ids"], rid
    info = scheduler.check_invariants()
    assert info["held_by_requests"] == 0, info
    assert scheduler.stats.aborted_requests >= 1


def _step_like_the_loop(scheduler: Any) -> list[RequestOutput]:
    """What the scheduler process does: a step that raises fails every request it holds."""
    try:
        return scheduler.step()
    except Exception:
        return scheduler.fail_all("internal error in the scheduler step")


def _finish_reasons(scheduler: Any, inputs: list[GenerateInput]) -> dict[str, dict]:
    """Run `inputs` to the end as the scheduler process does: {rid: finish reason}."""
    for inp in inputs:
        scheduler.add_request(inp)
    reasons: dict[str, dict] = {}
    for _ in range(100):
        if not scheduler.has_work:
            break
        for out in _step_like_the_loop(scheduler):
            if out.finish_reason is not None:
                reasons[out.rid] = out.finish_reason
    return reasons


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_failed_forward_answers_every_request_and_caches_nothing_unwritten(
    scheduler, monkeypatch, mode
):
    """A model failure fails the whole batch, but every request (including ones admitted by the
    failing prefill) gets an abort, no slot or lock leaks, and KV the failed pass never wrote is
    not served to later requests from the cache."""
    tok = scheduler.tokenizer.hf
    inputs = _requests(tok)[1:]
    scheduler.flush_cache()
    alone = _run(scheduler, inputs, fault=None)
    scheduler.flush_cache()

    real_forward = scheduler.runner.forward
    calls = {"n": 0}

    def failing_forward(fb: Any) -> Any:
        if fb.mode.value == mode:
            calls["n"] += 1
            raise RuntimeError("injected model fault")
        return real_forward(fb)

    monkeypatch.setattr(scheduler.runner, "forward", failing_forward)
    reasons = _finish_reasons(scheduler, inputs)
    monkeypatch.undo()
    assert calls["n"] >= 1
    assert set(reasons) == {inp.rid for inp in inputs}, reasons
    assert all(r["type"] == "abort" for r in reasons.values()), reasons
    info = scheduler.check_invariants()
    assert info["held_by_requests"] == 0, info
    assert scheduler.cache.protected_size() == 0, "a failed request left its prefix locked"

    again = _run(scheduler, inputs, fault=None)
    for inp in inputs:
        assert again[inp.rid]["ids"] == alone[inp.rid]["ids"], inp.rid


def test_failed_segment_assembly_answers_the_request_and_frees_its_slots(scheduler, monkeypatch):
    """A request assembled from cached segments whose forward fails ends with an error, the
    slots its assembly took go back (no retry loop over a leaking pool), and the same request
    is served afterwards."""
    tok = scheduler.tokenizer.hf
    doc = tok.encode(" The Prado museum is in Madrid, the capital of Spain.")
    head, question = tok.encode("Documents:"), tok.encode(" Where is the Prado? Answer:")
    ids = head + doc + question
    segmented = GenerateInput(
        "segmented",
        ids,
        {"max_new_tokens": 4, "temperature": 0},
        segments=[(len(head), len(head) + len(doc))],
    )
    scheduler.flush_cache()

    def failing_assembly(fb: Any, narrowing: Any) -> Any:
        raise RuntimeError("injected model fault")

    # The assembly's pass (the segment's fill is a plain prefill).
    monkeypatch.setattr(scheduler.runner, "forward_narrowing", failing_assembly)
    reasons = _finish_reasons(scheduler, [segmented])
    monkeypatch.undo()
    assert list(reasons) == ["segmented"], reasons  # the internal fill never surfaces
    assert reasons["segmented"]["type"] == "abort", reasons
    assert not scheduler.has_work
    info = scheduler.check_invariants()
    assert info["held_by_requests"] == 0 and info["free"] + info["cached"] == 4096, info
    again = _run(scheduler, [segmented], fault=None)
    assert again["segmented"]["reason"]["type"] in ("stop", "length"), again


def test_nan_logits_fail_only_their_request(scheduler, monkeypatch):
    """A numerically broken row (NaN logits) ends that request with an error; the others in the
    same decode batch produce exactly what they produce alone."""
    tok = scheduler.tokenizer.hf
    greedy = {"max_new_tokens": 16, "temperature": 0}
    inputs = [
        GenerateInput("plain", tok.encode("The capital of France is"), greedy),
        GenerateInput("broken", tok.encode("Once upon a time"), greedy),
        GenerateInput("other", tok.encode("def add(a, b):"), greedy),
    ]
    alone = _run(scheduler, [inputs[0], inputs[2]], fault=None)
    real_forward = scheduler.runner.forward

    def nan_forward(fb: Any) -> Any:
        logits = real_forward(fb)
        if fb.mode.value == "decode":
            for row, req in enumerate(scheduler.table.with_status(ReqStatus.RUNNING)):
                if req.rid == "broken":
                    logits = logits.clone()
                    logits[row] = float("nan")
        return logits

    monkeypatch.setattr(scheduler.runner, "forward", nan_forward)
    together = _run(scheduler, inputs, fault=None)
    monkeypatch.undo()
    reason = together["broken"]["reason"]
    assert reason["type"] == "abort" and "NaN" in reason["message"], reason
    for rid in ("plain", "other"):
        assert together[rid]["ids"] == alone[rid]["ids"], rid
    assert scheduler.check_invariants()["held_by_requests"] == 0


def test_non_streamed_request_gets_first_and_final_increment_only(scheduler):
    """`stream=False` (every non-streaming client): two messages, the first token (time to first
    token) and the rest with the finish reason, holding the same tokens, text and logprobs as
    the per-step increments of a streamed twin."""
    tok = scheduler.tokenizer.hf
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = tok.encode("Count: one, two,")
    runs: dict[bool, list[RequestOutput]] = {}
    for stream in (True, False):
        scheduler.add_request(
            GenerateInput(f"s{stream}", ids, params, return_logprob=True, stream=stream)
        )
        runs[stream] = []
        while scheduler.has_work:
            runs[stream] += scheduler.step()
    streamed, whole = runs[True], runs[False]
    assert len(streamed) == 12 and len(whole) == 2
    assert len(whole[0].new_token_ids) == 1 and whole[0].finish_reason is None
    assert whole[1].finish_reason == {"type": "length", "length": 12}
    join = lambda outs, f: [x for o in outs for x in getattr(o, f)]  # noqa: E731
    assert join(whole, "new_token_ids") == join(streamed, "new_token_ids")
    # (The second run reads the prompt from the cache: logprobs agree to rounding.)
    lp_whole, lp_streamed = (
        join(whole, "output_token_logprobs"),
        join(streamed, "output_token_logprobs"),
    )
    assert [t for _, t in lp_whole] == [t for _, t in lp_streamed]
    assert [v for v, _ in lp_whole] == pytest.approx([v for v, _ in lp_streamed], abs=1e-4)
    assert "".join(o.new_text for o in whole) == "".join(o.new_text for o in streamed)
    assert scheduler.check_invariants()["held_by_requests"] == 0


def test_a_sampler_failure_while_a_draft_is_verified_leaks_no_slot(scheduler, monkeypatch):
    """The draft's K/V slots are taken from the request before verification; a sampler that
    raises then (the whole step fails) still leaves every slot free, cached or held."""
    tok = scheduler.tokenizer.hf
    scheduler.flush_cache()
    inp = GenerateInput(
        "json",
        tok.encode("A person as JSON:"),
        {"max_new_tokens": 24, "temperature": 0, "regex": JSON_REGEX},
    )
    real = scheduler.sampler.sample_and_append
    drafted = scheduler.stats.jump_forward_drafted_tokens

    def failing(reqs: Any, logits: Any) -> Any:
        if scheduler.stats.jump_forward_drafted_tokens > drafted:  # inside verify
            raise RuntimeError("injected sampler fault")
        return real(reqs, logits)

    monkeypatch.setattr(scheduler.sampler, "sample_and_append", failing)
    reasons = _finish_reasons(scheduler, [inp])
    monkeypatch.undo()
    assert scheduler.stats.jump_forward_drafted_tokens > drafted  # a draft was verified
    assert reasons["json"]["type"] == "abort", reasons
    assert scheduler.check_invariants()["held_by_requests"] == 0
