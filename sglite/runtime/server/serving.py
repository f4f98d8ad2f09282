"""What the native and OpenAI routes share: admitting requests, reporting their aborts and
streaming their results as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from sglite.http.errors import APIError, error_body
from sglite.http.streaming import SSE_DONE, merge_streams, sse
from sglite.runtime.disaggregation.messages import Bootstrap
from sglite.runtime.scheduler.io import FinishReason
from sglite.runtime.scheduler.io import abort_status as status_of_abort
from sglite.runtime.server.state import ServerState
from sglite.runtime.tokenizer_manager import TokenizerManager
from sglite.runtime.tokenizing.request import GenerateRequest


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request`."""
    return request.app.state.sglite


def prepare_requests(
    state: ServerState,
    *,
    text: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    return_logprob: bool | list[bool] = False,
    logprob_start_len: int | list[int] | None = None,
    top_logprobs_num: int | list[int] | None = None,
    return_text_in_logprobs: bool = False,
    rid: str | list[str] | None = None,
    image_data: Any = None,
    image_items: list[Any] | None = None,
    bootstrap: Bootstrap | None = None,
    segments: list | None = None,
) -> tuple[list[GenerateRequest], bool]:
    """Validate, tokenize and expand (`n`) a request; admit it or raise 400 / 503.

    Returns the scheduler requests and whether the client asked for a batch. With `bootstrap`
    (disaggregated serving), the i-th scheduler request gets room `<room>.<i>`: the prefill and
    the decode server expand the same body in the same order.
    """
    tm = state.tokenizer_manager
    reqs, is_batch = tm.normalize(
        text, sampling_params, input_ids, return_logprob, logprob_start_len,
        top_logprobs_num, return_text_in_logprobs, rid=rid, image_data=image_data,
        image_items=image_items, segments=segments,
    )  # fmt: skip
    expanded = tm.expand_n(reqs)
    if bootstrap is not None:
        for i, req in enumerate(expanded):
            req.bootstrap = bootstrap.for_index(i)
    check_request_ids(tm, expanded)
    state.admit(len(expanded))
    return expanded, is_batch


def bootstrap_of(state: ServerState, body: Any) -> Bootstrap | None:
    """The body's `bootstrap_host/port/room` (set by the PD router), checked against this
    server's `--disaggregation-mode`; APIError 400 naming the field at fault."""
    names = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    fields = {n: getattr(body, n, None) for n in names}
    given = [n for n, v in fields.items() if v is not None]
    if not given:
        return None
    if state.args.disaggregation_mode is None:
        raise APIError(
            400,
            f"{given[0]}: this server does not serve disaggregated requests "
            "(start it with --disaggregation-mode prefill or decode)",
            param=given[0],
        )
    missing = [n for n, v in fields.items() if v is None]
    if missing:
        raise APIError(400, f"{missing[0]}: bootstrap fields come together", param=missing[0])
    port = fields["bootstrap_port"]
    if not 1 <= port <= 65535:
        message = f"bootstrap_port must be in [1, 65535], got {port}"
        raise APIError(400, message, param="bootstrap_port")
    return Bootstrap(str(fields["bootstrap_host"]), int(port), str(fields["bootstrap_room"]))


def check_request_ids(tm: TokenizerManager, reqs: list[GenerateRequest]) -> None:
    """400 unless the requests' ids are distinct and none is in flight (answers are routed by
    id: a shared one would leave a request waiting forever)."""
    rids = [r.rid for r in reqs]
    if len(set(rids)) != len(rids):
        raise APIError(400, "rid: request ids in one batch must be distinct", param="rid")
    for r in rids:
        if r in tm.in_flight:
            raise APIError(400, f"rid: a request with id {r!r} is already running", param="rid")


def abort_status(state: ServerState, reason: FinishReason) -> int:
    """HTTP status for a request ended with an abort: the status its `AbortKind` carries, 503
    while the server cannot serve (shutting down, the scheduler gone)."""
    if state.shutting_down or not state.client.alive:
        return 503
    return status_of_abort(reason)


def raise_if_aborted(state: ServerState, result: dict[str, Any]) -> None:
    """Turn an aborted result into an APIError (the client would otherwise get partial text)."""
    reason = result["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort":
        message = reason.get("message") or "the request was aborted"
        raise APIError(abort_status(state, reason), message)


def abort_event(state: ServerState, chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The SSE error body for a chunk that ends its request with an abort, else None."""
    reason = chunk["meta_info"].get("finish_reason") or {}
    if reason.get("type") != "abort":
        return None
    message = reason.get("message") or "the request was aborted"
    return error_body(abort_status(state, reason), message)


async def stream_events(
    state: ServerState,
    reqs: list[GenerateRequest],
    on_chunk: Callable[[int, dict[str, Any]], list[dict[str, Any]]],
    on_end: Callable[[], list[dict[str, Any]]],
) -> AsyncIterator[bytes]:
    """Run `reqs` as streams; `on_chunk(index, chunk)` and `on_end()` return events to send.

    An abort or an error ends the stream with one error event (then no `on_end`); the stream
    always ends with `data: [DONE]`.
    """
    tm = state.tokenizer_manager
    try:
        async for i, chunk in merge_streams([tm.stream(r) for r in reqs]):
            error = abort_event(state, chunk)
            if error is not None:
                yield sse(error)
                break
            for event in on_chunk(i, chunk):
                yield sse(event)
        else:
            for event in on_end():
                yield sse(event)
    except Exception as exc:
        yield sse(error_body(503 if not state.client.alive else 500, str(exc)))
    yield SSE_DONE
