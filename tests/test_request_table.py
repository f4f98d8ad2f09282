"""The scheduler's request table: one status per request, checked transitions, and abort /
shutdown reaching a request in every status (partly prefilled and segment-waiting included)."""

from __future__ import annotations

import pytest

from sglite.runtime.scheduler.io import AbortKind, GenerateInput
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable, TransitionError
from sglite.runtime.server_args import ServerArgs

JSON_REGEX = r'\{"name": "[A-Za-z ]{1,20}", "age": [0-9]{1,2}\}'


class FakeReq:
    """The table reads only `rid`."""

    def __init__(self, rid: str) -> None:
        self.rid = rid


def test_the_table_refuses_moves_the_lifecycle_lacks():
    table = RequestTable()
    a, b = FakeReq("a"), FakeReq("b")
    table.add(a, ReqStatus.WAITING)
    with pytest.raises(TransitionError, match="already in the table"):
        table.add(a, ReqStatus.WAITING)
    with pytest.raises(TransitionError, match="cannot start"):
        table.add(b, ReqStatus.RUNNING)
    with pytest.raises(TransitionError, match="from WAITING to RUNNING"):
        table.move(a, ReqStatus.RUNNING)
    table.move(a, ReqStatus.PREFILLING)
    table.move(a, ReqStatus.CHUNKED)
    table.add(b, ReqStatus.WAITING)
    table.move(b, ReqStatus.PREFILLING)
    with pytest.raises(TransitionError, match="one request"):
        table.move(b, ReqStatus.CHUNKED)
    assert table.chunked is a and table.status(b) is ReqStatus.PREFILLING
    with pytest.raises(TransitionError, match="not in the table"):
        table.move(FakeReq("c"), ReqStatus.PREFILLING)


def test_a_retracted_request_goes_first_and_finished_ones_leave():
    table = RequestTable()
    reqs = [FakeReq(rid) for rid in "abc"]
    for req in reqs:
        table.add(req, ReqStatus.WAITING)
    table.move(reqs[2], ReqStatus.PREFILLING)
    table.move(reqs[2], ReqStatus.RUNNING)
    table.move(reqs[2], ReqStatus.WAITING, front=True)
    assert [r.rid for r in table.with_status(ReqStatus.WAITING)] == ["c", "a", "b"]
    assert table.remove(reqs[0]) is ReqStatus.WAITING
    assert table.remove(reqs[0]) is None
    assert len(table) == 2 and table.get("a") is None and table.get("b") is reqs[1]


@pytest.fixture(scope="module")
def scheduler():
    import torch

    from sglite.runtime.model.loader import load_model
    from sglite.runtime.scheduler.scheduler import Scheduler

    torch.manual_seed(0)
    loaded = load_model(None, "float32", progress=False)
    args = ServerArgs(dtype="float32", max_total_tokens=4096, chunked_prefill_size=64)
    return Scheduler(args, loaded)


def test_shutdown_ends_a_request_in_every_status_and_frees_everything(scheduler):
    """A running, a partly prefilled, a waiting, a segment-waiting and a grammar-compiling
    request: aborting all answers each with the abort's status and leaves no slot held."""
    tok = scheduler.tokenizer
    greedy = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    scheduler.add_request(GenerateInput("running", tok.encode("The capital of France is"), greedy))
    scheduler.step()
    long_prompt = tok.encode(" ".join(f"word{i}" for i in range(150)))
    assert len(long_prompt) > 2 * 64
    scheduler.add_request(GenerateInput("chunked", long_prompt, greedy))
    scheduler.step()
    scheduler.add_request(GenerateInput("waiting", tok.encode("Once upon a time"), greedy))
    head, doc = tok.encode("Document:"), tok.encode(" The Prado museum is in Madrid.")
    scheduler.add_request(
        GenerateInput("segmented", head + doc, greedy, segments=[(len(head), len(head + doc))])
    )
    scheduler.add_request(
        GenerateInput("grammar", tok.encode("A person:"), {**greedy, "regex": JSON_REGEX})
    )
    table = scheduler.table
    statuses = {rid: table.status(table.get(rid)) for rid in
                ("running", "chunked", "waiting", "segmented", "grammar")}  # fmt: skip
    assert statuses == {
        "running": ReqStatus.RUNNING,
        "chunked": ReqStatus.CHUNKED,
        "waiting": ReqStatus.WAITING,
        "segmented": ReqStatus.SEGMENTS,
        "grammar": ReqStatus.GRAMMAR,
    }
    scheduler.abort_all("the server is shutting down", AbortKind.UNAVAILABLE)
    reasons = {out.rid: out.finish_reason for out in scheduler.collect_outputs()}
    assert set(reasons) == set(statuses), reasons  # the internal segment fill never surfaces
    for reason in reasons.values():
        assert reason["type"] == "abort" and reason["status_code"] == 503, reason
    assert len(table) == 0 and not scheduler.has_work
    assert scheduler.check_invariants()["held_by_requests"] == 0
    assert scheduler.cache.protected_size() == 0


def test_abort_kinds_carry_their_http_status(scheduler):
    tok = scheduler.tokenizer
    prompt = tok.encode("hi") * scheduler.context_len
    too_long = GenerateInput("too-long", prompt, {"max_new_tokens": 1})
    scheduler.add_request(too_long)
    scheduler.add_request(GenerateInput("cancelled", tok.encode("Hello"), {"max_new_tokens": 8}))
    scheduler.abort("cancelled", "aborted by the client")
    reasons = {out.rid: out.finish_reason for out in scheduler.collect_outputs()}
    assert reasons["too-long"]["status_code"] == 400
    assert reasons["too-long"]["err_type"] == "invalid_request_error"
    assert reasons["cancelled"]["err_type"] == "cancelled"
    assert "context length" in reasons["too-long"]["message"]
    assert len(scheduler.table) == 0
