"""The scheduler's side of disaggregated prefill and decode (docs/pd.md).

`PrefillHandoff` (a prefill server) hands each bootstrapped request's KV to its decode server
after the first token; `DecodeIntake` (a decode server) admits bootstrapped requests by pulling
their prompt's KV instead of prefilling it. Both are driven by the scheduler process's loop
(`poll`, whenever their socket has messages and at least once a second, for deadlines) and by
the scheduler at the points named in their methods.
"""

from __future__ import annotations

from typing import Any

import zmq

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.disaggregation.decode_side import KVReceiver
from sglite.runtime.disaggregation.messages import KVDone
from sglite.runtime.disaggregation.prefill_side import KVSender
from sglite.runtime.scheduler.budget import KVBudget
from sglite.runtime.scheduler.io import AbortKind, RequestOutput
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.output import OutputProcessor
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable
from sglite.runtime.scheduler.stats import SchedulerStats
from sglite.runtime.server_args import ServerArgs


class PrefillHandoff:
    """A prefill server: bootstrapped requests end after their first token, their KV sent on."""

    def __init__(
        self,
        args: ServerArgs,
        pool: KVPool,
        cache: RadixCache,
        output: OutputProcessor,
        stats: SchedulerStats,
    ) -> None:
        self.output = output
        self.sender = KVSender(
            pool,
            cache,
            args.host,
            args.disaggregation_bootstrap_port,
            args.disaggregation_transfer_timeout,
            stats,
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
        self.output.append_token(req, tok, logprob, top)
        self.output.finish(req, {"type": "length", "length": len(req.output_ids)})

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

    def remove(self, req: Req) -> None:
        return None

    def close(self) -> None:
        self.sender.close()


class DecodeIntake:
    """A decode server: bootstrapped requests get their prompt's KV from their prefill server."""

    def __init__(
        self,
        args: ServerArgs,
        kv: RequestKVManager,
        output: OutputProcessor,
        table: RequestTable,
        budget: KVBudget,
        stats: SchedulerStats,
    ) -> None:
        self.kv = kv
        self.output = output
        self.table = table
        self.budget = budget
        self.receiver = KVReceiver(
            kv, args.disaggregation_transfer_backend, args.disaggregation_transfer_timeout, stats
        )

    def admit(self, req: Req) -> bool:
        """Take a bootstrapped request (True: it waits in `TRANSFER` until its pages are all
        here); others are prefilled here as usual."""
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
        if self.receiver.queued:  # the reserve sums over running requests: only when needed
            self.receiver.admit(self.budget.reserved_tokens())
        ready, failed = self.receiver.poll()
        for req, message in failed:
            self.kv.discard(req)  # its pages may be half-written: never cached
            self.output.abort(req, message, AbortKind.UPSTREAM)
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
        self.kv.cache_unfinished(req)
        req.input_logprobs_pending = list(done.input_token_logprobs)
        req.input_top_pending = list(done.input_top_logprobs)
        req.input_logprobs_done = True
        req.sampling.skip_draw()  # the prefill server drew the first token's random number
        try:
            self.output.append_token(req, done.first_token, done.logprob, done.top_logprobs)
        except Exception as exc:
            self.output.fail(req, exc)
            return
        if not req.finished:
            self.table.move(req, ReqStatus.RUNNING)

    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose messages `poll` reads (one per prefill server seen)."""
        return list(self.receiver.sockets.values())

    @property
    def busy(self) -> bool:
        return self.receiver.busy

    def holders(self) -> list[Any]:
        """None beside the request table: the requests receiving pages are in it."""
        return []

    def remove(self, req: Req) -> None:
        """Take an aborted request out; its slots go back uncached."""
        if self.receiver.remove(req.rid) is not None:
            self.kv.discard(req)

    def close(self) -> None:
        self.receiver.close()


Disaggregation = PrefillHandoff | DecodeIntake
