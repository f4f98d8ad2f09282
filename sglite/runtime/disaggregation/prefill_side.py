"""The prefill scheduler's half: hold each handed-off request's KV until its decode server has
pulled it, streaming pages as prefill chunks finish.

A request with a `Bootstrap` is prefilled as usual; when its first token is sampled
(`hand_off`), the sender takes over its KV (an extra lock on its cached prefix, or its own
slots when the radix cache is off), records the first token, and the request finishes here
with one output token. Pages go out when the decode server's `KVPull` for the room has arrived:
what is computed at once (chunked prefills: after each chunk), the rest and a `KVDone` at
hand-off.

Invariants:
- a held request's pages stay locked in the cache (or owned here) until they are sent, the
  decode side cancels, or its deadline passes; then they are released exactly once;
- `holders()` reports the slots owned here, so the pool accounting check counts them.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tree_node import TreeNode
from sglite.runtime.disaggregation.messages import KVCancel, KVDone, KVFailed, KVPages, KVPull
from sglite.runtime.disaggregation.pages import checksum, gather_pages
from sglite.runtime.disaggregation.transport import TRANSPORTS, KVTransport, make_transport
from sglite.runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)

# Most tokens per KVPages message: bounds one message's memory (about 46 MB for SmolLM2-135M
# in float32) and lets the receiver write pages while later ones are in flight.
MAX_PAGES_PER_MESSAGE = 1024


@dataclass
class Handoff:
    """A prefilled request's KV, held for its decode server."""

    room: str
    kv_slots: list[int]  # the prompt's slots
    cached_len: int  # kv_slots[:cached_len] are the cache's (locked through node), the rest ours
    node: TreeNode | None
    done: KVDone
    deadline: float


@dataclass
class Pull:
    """A decode server's request for a room's pages."""

    identity: bytes
    request: KVPull
    deadline: float
    sent: int = 0  # prompt tokens sent so far (from request.skip on)
    transport_files: list[dict[str, Any]] = field(default_factory=list)


class KVSender:
    """The bootstrap socket of a prefill server and the hand-offs it serves."""

    def __init__(
        self,
        pool: KVPool,
        cache: RadixCache,
        host: str,
        port: int,
        timeout: float,
        stats: SchedulerStats,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.timeout = timeout
        self.stats = stats
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished decode server raises
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://{host}:{port}")
        self.transports: dict[str, KVTransport] = {n: make_transport(n) for n in TRANSPORTS}
        self.handoffs: dict[str, Handoff] = {}
        self.pulls: dict[str, Pull] = {}
        # Shared-memory payloads sent and maybe never read: (deadline, transport, meta).
        self.unread: list[tuple[float, KVTransport, dict[str, Any]]] = []

    # ------------------------------------------------------------------ scheduler hooks
    def hand_off(self, room: str, req: Any, done: KVDone) -> None:
        """Take `req`'s prompt KV for `room` (call before the request finishes: its own slots
        become ours, its cached prefix gets one more lock) and send what the pull allows."""
        slots = list(req.kv_slots)
        if req.last_node is not None:
            self.cache.lock(req.last_node)
        deadline = time.monotonic() + self.timeout
        self.handoffs[room] = Handoff(room, slots, req.cached_len, req.last_node, done, deadline)
        req.kv_slots = req.kv_slots[: req.cached_len]  # finishing releases only the cache part
        self._serve(room)

    def prefilled_chunk(self, room: str, slots: list[int]) -> None:
        """A chunk of `room`'s prompt finished: stream its pages if the decode side asked."""
        pull = self.pulls.get(room)
        if pull is not None and not self._send_pages(room, pull, slots):
            del self.pulls[room]  # the decode server is gone: the hand-off waits out its deadline

    def fail(self, room: str, message: str) -> None:
        """`room`'s request ended without a hand-off: tell a waiting decode server."""
        pull = self.pulls.pop(room, None)
        if pull is not None:
            self._send(pull.identity, KVFailed(room, message))

    # ------------------------------------------------------------------ socket
    def poll(self) -> None:
        """Read every pending message from decode servers, then expire old hand-offs."""
        while True:
            try:
                identity, raw = self.socket.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                break
            try:
                msg = pickle.loads(raw)
            except Exception:
                logger.warning("dropping an unreadable bootstrap message")
                continue
            if isinstance(msg, KVPull):
                self._on_pull(identity, msg)
            elif isinstance(msg, KVCancel):
                self.pulls.pop(msg.room, None)
                self._release(msg.room)
        self._expire(time.monotonic())

    def _on_pull(self, identity: bytes, msg: KVPull) -> None:
        if msg.transport not in self.transports:
            self._send(identity, KVFailed(msg.room, f"unknown KV transport {msg.transport!r}"))
            return
        # Twice the timeout: the decode server times out first and cancels; this only
        # forgets pulls whose cancel was lost (a decode server that died).
        self.pulls[msg.room] = Pull(identity, msg, time.monotonic() + 2 * self.timeout)
        self._serve(msg.room)

    def _serve(self, room: str) -> None:
        """Send a room's remaining pages and its KVDone once both sides are ready."""
        pull, handoff = self.pulls.get(room), self.handoffs.get(room)
        if pull is None or handoff is None:
            return
        del self.pulls[room]
        if pull.request.num_tokens != len(handoff.kv_slots):
            message = (
                f"the decode server tokenized {pull.request.num_tokens} prompt tokens, the "
                f"prefill server {len(handoff.kv_slots)}: they must serve the same model"
            )
            self._send(pull.identity, KVFailed(room, message))
        elif self._send_pages(room, pull, handoff.kv_slots) and self._send(
            pull.identity, handoff.done
        ):
            self.stats.disaggregation_transfers += 1
        self._release(room)

    def _send_pages(self, room: str, pull: Pull, slots: list[int]) -> bool:
        """Send pages [max(sent, skip), len(slots)) in bounded messages; False if the decode
        server is gone."""
        start = max(pull.sent, pull.request.skip)
        transport = self.transports[pull.request.transport]
        while start < len(slots):
            count = min(MAX_PAGES_PER_MESSAGE, len(slots) - start)
            payload = gather_pages(self.pool, slots[start : start + count])
            meta, frames = transport.pack(payload)
            header = KVPages(room, start, count, transport.name, meta, checksum(payload))
            if not self._send(pull.identity, header, frames):
                transport.discard(meta)
                return False
            if not frames:
                self.unread.append((time.monotonic() + self.timeout, transport, meta))
            self.stats.disaggregation_transferred_tokens += count
            self.stats.disaggregation_transfer_bytes += payload.nbytes
            start += count
            pull.sent = start
        return True

    def _send(self, identity: bytes, header: Any, frames: list[Any] | None = None) -> bool:
        try:
            self.socket.send_multipart([identity, pickle.dumps(header), *(frames or [])])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the decode server went away
            logger.warning("decode server gone for room %s: %s", header.room, exc)
            self.stats.disaggregation_failed_transfers += 1
            return False
        return True

    # ------------------------------------------------------------------ freeing
    def _release(self, room: str) -> None:
        handoff = self.handoffs.pop(room, None)
        if handoff is None:
            return
        self.pool.free(handoff.kv_slots[handoff.cached_len :])
        if handoff.node is not None:
            self.cache.unlock(handoff.node)

    def _expire(self, now: float) -> None:
        for room in [r for r, h in self.handoffs.items() if h.deadline < now]:
            logger.warning("room %s: no decode server pulled its KV in time; freeing it", room)
            self.stats.disaggregation_failed_transfers += 1
            self._release(room)
        for room in [r for r, p in self.pulls.items() if p.deadline < now]:
            self.fail(room, "the prefill of this request did not finish in time")
        while self.unread and self.unread[0][0] < now:
            _, transport, meta = self.unread.pop(0)
            transport.discard(meta)

    # ------------------------------------------------------------------ checks
    @property
    def busy(self) -> bool:
        """True while pages are held for a decode server."""
        return bool(self.handoffs)

    def holders(self) -> list[Handoff]:
        """The hand-offs holding slots (they have `kv_slots` and `cached_len`, as requests)."""
        return list(self.handoffs.values())

    def close(self) -> None:
        """Free everything held and close the socket."""
        for room in list(self.handoffs):
            self._release(room)
        for _, transport, meta in self.unread:
            transport.discard(meta)
        self.socket.close(linger=0)
        self.context.term()
