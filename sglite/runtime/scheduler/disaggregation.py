"""The scheduler's side of disaggregated prefill and decode (docs/pd.md).

`PrefillHandoff` (a prefill server) hands each bootstrapped request's KV to its decode server
after the first token; `DecodeIntake` (a decode server) admits bootstrapped requests by pulling
their prompt's KV instead of prefilling it. Both are driven by the scheduler process's loop
(`poll`, whenever their socket has messages and at least once a second, for deadlines) and by
the scheduler at the points named in their methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import zmq

from sglite.runtime.disaggregation.decode_side import KVReceiver
from sglite.runtime.disaggregation.messages import KVDone
from sglite.runtime.disaggregation.prefill_side import KVSender
from sglite.runtime.scheduler.io import RequestOutput
from sglite.runtime.scheduler.request import Req

if TYPE_CHECKING:
    from sglite.runtime.scheduler.scheduler import Scheduler

COUNTERS = (
    "prefill_tokens_computed",
    "disaggregation_transfers",
    "disaggregation_transferred_tokens",
    "disaggregation_transfer_bytes",
    "disaggregation_failed_transfers",
)


class PrefillHandoff:
    """A prefill server: bootstrapped requests end after their first token, their KV sent on."""

    def __init__(self, scheduler: Scheduler) -> None:
        args = scheduler.args
        self.scheduler = scheduler
        self.sender = KVSender(
            scheduler.pool,
            scheduler.cache,
            args.host,
            args.disaggregation_bootstrap_port,
            args.disaggregation_transfer_timeout,
            scheduler.counters,
        )
        self.rooms: dict[str, str] = {}  # rid -> room of bootstrapped requests not handed off

    def admit(self, req: Req) -> bool:
        """Remember a bootstrapped request's room; it is prefilled as usual (returns False)."""
        if req.bootstrap is not None:
            self.rooms[req.rid] = req.bootstrap.room
        return False

    def prefilled_chunk(self, req: Req) -> None:
        """After a chunk of `req`'s prompt: stream the pages if its decode server asked."""
        room = self.rooms.get(req.rid)
        if room is not None:
            self.sender.prefilled_chunk(room, req.kv_slots)

    def takes_token(self, req: Req) -> bool:
        """True for a bootstrapped request's first token (`append_first_token` handles it)."""
        return req.rid in self.rooms and not req.output_ids

    def append_first_token(self, req: Req, tok: int, logprob: float | None, top: Any) -> None:
        """Hand `req`'s KV off with its first token, then end it here with that token."""
        room = self.rooms.pop(req.rid)
        done = KVDone(
            room,
            len(req.prompt_ids),
            tok,
            logprob,
            top,
            list(req.input_logprobs_pending),
            list(req.input_top_pending),
        )
        self.sender.hand_off(room, req, done)
        output = self.scheduler.output
        output.append_token(req, tok, logprob, top)
        output.finish(req, {"type": "length", "length": len(req.output_ids)})

    def ended(self, outputs: list[RequestOutput]) -> None:
        """Requests that ended before their hand-off: their decode servers are told."""
        for out in outputs:
            if out.finish_reason is not None and out.rid in self.rooms:
                message = (out.finish_reason or {}).get("message") or "the request ended"
                self.sender.fail(self.rooms.pop(out.rid), message)

    def poll(self) -> None:
        """Serve decode servers' messages; free hand-offs past their deadline."""
        self.sender.poll()

    def info(self) -> dict[str, int]:
        """Requests in flight between the servers, for get_server_info."""
        return {
            "disaggregation_held_requests": len(self.sender.handoffs),
            "disaggregation_waiting_pulls": len(self.sender.pulls),
        }

    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose messages `poll` reads."""
        return [self.sender.socket]

    @property
    def busy(self) -> bool:
        return self.sender.busy

    def holders(self) -> list[Any]:
        return self.sender.holders()

    def requests(self) -> list[Req]:
        return []

    def remove(self, rid: str) -> Req | None:
        return None

    def close(self) -> None:
        self.sender.close()


class DecodeIntake:
    """A decode server: bootstrapped requests get their prompt's KV from their prefill server."""

    def __init__(self, scheduler: Scheduler) -> None:
        args = scheduler.args
        self.scheduler = scheduler
        self.receiver = KVReceiver(
            scheduler.kv,
            args.disaggregation_transfer_backend,
            args.disaggregation_transfer_timeout,
            scheduler.counters,
        )

    def admit(self, req: Req) -> bool:
        """Take a bootstrapped request (True); others are prefilled here as usual."""
        if req.bootstrap is None or req.params.max_new_tokens == 0:
            return False  # a prefill-only request is computed here
        self.receiver.add(req, req.bootstrap)
        return True

    def prefilled_chunk(self, req: Req) -> None:
        return None

    def takes_token(self, req: Req) -> bool:
        return False

    def append_first_token(self, req: Req, tok: int, logprob: float | None, top: Any) -> None:
        raise AssertionError("a decode server samples no first tokens for a prefill server")

    def ended(self, outputs: list[RequestOutput]) -> None:
        return None

    def poll(self) -> None:
        """Allocate for queued requests, write arriving pages, start the complete ones."""
        sched = self.scheduler
        if self.receiver.queued:  # the reserve sums over running requests: only when needed
            self.receiver.admit(sched.reserved_tokens())
        ready, failed = self.receiver.poll()
        for req, message in failed:
            sched.kv.discard(req)  # its pages may be half-written: never cached
            sched.output.abort(req, message)
        for req, done in ready:
            self._start(req, done)

    def info(self) -> dict[str, int]:
        """Requests waiting for slots or pages, for get_server_info."""
        return {
            "disaggregation_queued_requests": len(self.receiver.queued),
            "disaggregation_receiving_requests": len(self.receiver.transfers),
        }

    def _start(self, req: Req, done: KVDone) -> None:
        """`req`'s prompt KV is all here: append the prefill server's first token and run it,
        as if this server had prefilled it."""
        sched = self.scheduler
        sched.kv.cache_unfinished(req)
        req.input_logprobs_pending = list(done.input_token_logprobs)
        req.input_top_pending = list(done.input_top_logprobs)
        req.input_logprobs_done = True
        req.sampling.skip_draw()  # the prefill server drew the first token's random number
        try:
            sched.output.append_token(req, done.first_token, done.logprob, done.top_logprobs)
        except Exception as exc:
            sched.fail_request(req, exc)
            return
        if not req.finished:
            sched.running.append(req)

    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose messages `poll` reads (one per prefill server seen)."""
        return list(self.receiver.sockets.values())

    @property
    def busy(self) -> bool:
        return self.receiver.busy

    def holders(self) -> list[Any]:
        return self.receiver.holders()

    def requests(self) -> list[Req]:
        return self.receiver.requests()

    def remove(self, rid: str) -> Req | None:
        """Take an aborted request out; its slots go back uncached."""
        req = self.receiver.remove(rid)
        if req is not None:
            self.scheduler.kv.discard(req)
        return req

    def close(self) -> None:
        self.receiver.close()


Disaggregation = PrefillHandoff | DecodeIntake


def build_disaggregation(scheduler: Scheduler) -> Disaggregation | None:
    """The scheduler's PD half for `--disaggregation-mode`, None when it is off."""
    mode = scheduler.args.disaggregation_mode
    if mode == "prefill":
        return PrefillHandoff(scheduler)
    if mode == "decode":
        return DecodeIntake(scheduler)
    return None
