"""The decode scheduler's half: give each handed-off request slots, pull its prompt's pages from
its prefill server, and return it ready to decode.

A request with a `Bootstrap` never enters the prefill queue here. `admit` takes the longest
prefix of its prompt in this server's own radix cache, allocates slots for the rest and sends a
`KVPull` to the prefill server; `poll` writes arriving pages into those slots (checksum first)
and, at `KVDone`, returns the request with its first token to the scheduler, which starts
decoding it. No prompt token is computed here.

Invariants:
- a request in `transfers` holds its prefix lock and its allocated slots (`holders()`), whose
  K/V is trusted only once every page arrived: a failed transfer frees them uncached;
- every transfer ends exactly once: completed, failed (abort naming why) or cancelled.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any

import zmq

from sglite.runtime.disaggregation.messages import (
    Bootstrap,
    KVCancel,
    KVDone,
    KVFailed,
    KVPages,
    KVPull,
)
from sglite.runtime.disaggregation.pages import checksum, scatter_pages
from sglite.runtime.disaggregation.transport import (
    TRANSPORTS,
    KVTransport,
    choose_transport,
    make_transport,
)
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    """One request whose prompt pages are on their way."""

    req: Req
    bootstrap: Bootstrap
    skip: int  # prompt tokens taken from this server's cache
    deadline: float  # the transfer fails if nothing arrives before it (moved on by each page)
    received: int = 0  # prompt tokens written (from skip on, in order)


class KVReceiver:
    """Pulls prompt pages from prefill servers into this server's pool."""

    def __init__(
        self,
        kv: RequestKVManager,
        transfer_backend: str,
        timeout: float,
        stats: SchedulerStats,
    ) -> None:
        self.kv = kv
        self.transfer_backend = transfer_backend
        self.timeout = timeout
        self.stats = stats
        self.context = zmq.Context()
        self.sockets: dict[tuple[str, int], zmq.Socket] = {}
        self.transports: dict[str, KVTransport] = {n: make_transport(n) for n in TRANSPORTS}
        self.queued: list[tuple[Req, Bootstrap]] = []  # waiting for slots
        self.transfers: dict[str, Transfer] = {}

    # ------------------------------------------------------------------ scheduler hooks
    def add(self, req: Req, bootstrap: Bootstrap) -> None:
        """Queue a request whose prefill runs on `bootstrap`'s server."""
        req.arrival_time = req.arrival_time or time.monotonic()
        self.queued.append((req, bootstrap))

    def admit(self, reserved: int) -> None:
        """Give queued requests slots (in arrival order, keeping `reserved` free for running
        requests' output) and ask their prefill servers for the pages."""
        while self.queued:
            req, bootstrap = self.queued[0]
            matched = self.kv.match_and_lock(req)
            need = len(req.prompt_ids) - matched
            if not self.kv.can_fit(need, reserved):
                self.kv.unlock(req)
                return
            self.queued.pop(0)
            req.kv_slots.extend(self.kv.alloc(need))
            req.cached_tokens, req.admitted_once = matched, True
            self.kv.record_admission(req)
            self.kv.cache.record_query(len(req.prompt_ids), matched)
            deadline = time.monotonic() + self.timeout
            transfer = Transfer(req, bootstrap, matched, deadline, received=matched)
            self.transfers[bootstrap.room] = transfer
            transport = choose_transport(self.transfer_backend, bootstrap.host)
            pull = KVPull(bootstrap.room, matched, len(req.prompt_ids), transport)
            self._socket(bootstrap).send(pickle.dumps(pull))

    def poll(self) -> tuple[list[tuple[Req, KVDone]], list[tuple[Req, str]]]:
        """Write arriving pages. Returns the requests whose pages all arrived (with their first
        token) and those whose transfer failed (with why), both out of this receiver."""
        ready: list[tuple[Req, KVDone]] = []
        failed: list[tuple[Req, str]] = []
        for sock in self.sockets.values():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_message(frames, ready, failed)
        now = time.monotonic()
        for room in [r for r, t in self.transfers.items() if t.deadline < now]:
            transfer = self._end(room, cancel=True)
            failed.append((transfer.req, self._timeout_message(transfer)))
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        """Take a request out (aborted here); the prefill side is told to drop its pages."""
        for i, (req, _) in enumerate(self.queued):
            if req.rid == rid:
                del self.queued[i]
                return req
        for room, transfer in self.transfers.items():
            if transfer.req.rid == rid:
                return self._end(room, cancel=True).req
        return None

    # ------------------------------------------------------------------ messages
    def _on_message(
        self,
        frames: list[Any],
        ready: list[tuple[Req, KVDone]],
        failed: list[tuple[Req, str]],
    ) -> None:
        try:
            msg = pickle.loads(frames[0].bytes)
        except Exception:
            logger.warning("dropping an unreadable message from a prefill server")
            return
        transfer = self.transfers.get(getattr(msg, "room", None))
        if transfer is None:  # ended here already (timed out, aborted)
            if isinstance(msg, KVPages) and msg.transport in self.transports:
                self.transports[msg.transport].discard(msg.meta)
            return
        if isinstance(msg, KVPages):
            problem = self._write(transfer, msg, frames[1:])
            if problem is not None:
                failed.append((self._end(msg.room, cancel=True).req, problem))
        elif isinstance(msg, KVDone):
            if transfer.received != len(transfer.req.prompt_ids):
                message = (
                    f"KV transfer incomplete: {transfer.received} of "
                    f"{len(transfer.req.prompt_ids)} prompt tokens arrived"
                )
                failed.append((self._end(msg.room, cancel=True).req, message))
            else:
                ready.append((self._end(msg.room, cancel=False, ok=True).req, msg))
        elif isinstance(msg, KVFailed):
            message = f"the prefill server failed this request: {msg.message}"
            failed.append((self._end(msg.room, cancel=False).req, message))

    def _write(self, transfer: Transfer, msg: KVPages, frames: list[Any]) -> str | None:
        """Check and store one KVPages; the problem as text when it cannot be used."""
        if msg.start != transfer.received:
            return f"KV transfer failed: pages from {msg.start}, expected {transfer.received}"
        end = msg.start + msg.count
        if end > len(transfer.req.prompt_ids):
            return f"KV transfer failed: pages up to {end}, past the prompt's end"
        try:
            transport = self._transport(msg)
            payload = transport.unpack(msg.meta, frames)
            if checksum(payload) != msg.checksum:
                return "KV transfer checksum mismatch: the pages were damaged in transit"
            scatter_pages(self.kv.pool, transfer.req.kv_slots[msg.start : end], payload)
        except (OSError, ValueError) as exc:
            return f"KV transfer failed: {exc}"
        transfer.received = end
        transfer.deadline = time.monotonic() + self.timeout  # a deadline for silence, not size
        self.stats.disaggregation_transferred_tokens += msg.count
        self.stats.disaggregation_transfer_bytes += int(msg.meta.get("nbytes", 0))
        return None

    def _transport(self, msg: KVPages) -> KVTransport:
        transport = self.transports.get(msg.transport)
        if transport is None:
            raise ValueError(f"unknown KV transport {msg.transport!r}")
        return transport

    def _end(self, room: str, cancel: bool, ok: bool = False) -> Transfer:
        """Take a room's transfer out; `cancel` tells its prefill server to drop the pages."""
        transfer = self.transfers.pop(room)
        if cancel:
            self._socket(transfer.bootstrap).send(pickle.dumps(KVCancel(room)))
        if ok:
            self.stats.disaggregation_transfers += 1
        else:
            self.stats.disaggregation_failed_transfers += 1
        return transfer

    def _timeout_message(self, transfer: Transfer) -> str:
        where = f"{transfer.bootstrap.host}:{transfer.bootstrap.port}"
        return (
            f"KV transfer from the prefill server {where} timed out: nothing came for "
            f"{self.timeout:g} s ({transfer.received} of {len(transfer.req.prompt_ids)} prompt "
            "tokens arrived)"
        )

    def _socket(self, bootstrap: Bootstrap) -> zmq.Socket:
        key = (bootstrap.host, bootstrap.port)
        sock = self.sockets.get(key)
        if sock is None:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(f"tcp://{bootstrap.host}:{bootstrap.port}")
            self.sockets[key] = sock
        return sock

    # ------------------------------------------------------------------ checks
    @property
    def busy(self) -> bool:
        """True while requests wait for slots or pages."""
        return bool(self.queued or self.transfers)

    def holders(self) -> list[Req]:
        """Requests holding slots while their pages arrive."""
        return [t.req for t in self.transfers.values()]

    def requests(self) -> list[Req]:
        """Every request in this receiver (queued or transferring)."""
        return [req for req, _ in self.queued] + self.holders()

    def close(self) -> None:
        """Close the sockets (requests must have been ended by the scheduler)."""
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.context.term()
