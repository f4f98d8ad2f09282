"""The scheduler's one table of requests: every request it holds, by id, with its status.

A request is in the table from the moment the scheduler accepts it until it finishes, and in
exactly one status. Every change of status goes through `move`, which refuses a transition the
lifecycle below does not have, so a request can never be in two queues or fall out of all of
them. Abort, shutdown, a failed step and the invariant check iterate the table, so none of
them can miss a request, whichever manager is working on it.

Lifecycle (`ALLOWED`):

    new ─► GRAMMAR ─► WAITING ◄────────────────────────────┐ (retracted)
     │       │   └──► SEGMENTS ─► RUNNING                   │
     │       └──────► TRANSFER ─► RUNNING                   │
     └─► WAITING ─► PREFILLING ─► RUNNING ──────────────────┤
                         ▲    └─► CHUNKED ──────────────────┘
                         └────────────┘

Finishing (`OutputProcessor.finish`) removes a request from any status.

Invariants: a request id is in at most one status; `CHUNKED` holds at most one request; the
order within a status is the order requests entered it (`front=True` puts a retracted request
first in `WAITING`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from sglite.runtime.scheduler.request import Req


class ReqStatus(enum.Enum):
    """Where a request is in its life inside the scheduler."""

    GRAMMAR = "compiling its grammar"
    SEGMENTS = "waiting for its segments to be cached"
    TRANSFER = "receiving its prompt's KV from a prefill server"
    WAITING = "waiting to be prefilled"
    PREFILLING = "in this step's prefill"
    CHUNKED = "partly prefilled"
    RUNNING = "decoding"


S = ReqStatus
# Statuses a request may enter first (`add`), and the moves between statuses.
ENTRY = frozenset({S.GRAMMAR, S.SEGMENTS, S.TRANSFER, S.WAITING})
ALLOWED: dict[ReqStatus, frozenset[ReqStatus]] = {
    S.GRAMMAR: frozenset({S.WAITING, S.SEGMENTS, S.TRANSFER}),
    S.SEGMENTS: frozenset({S.RUNNING}),
    S.TRANSFER: frozenset({S.RUNNING}),
    S.WAITING: frozenset({S.PREFILLING}),
    S.PREFILLING: frozenset({S.RUNNING, S.CHUNKED}),
    S.CHUNKED: frozenset({S.PREFILLING, S.WAITING}),
    S.RUNNING: frozenset({S.WAITING}),
}


class TransitionError(RuntimeError):
    """A status change the lifecycle does not have: a scheduler bug, never a request's fault."""


class RequestTable:
    """Every request the scheduler holds (see module invariants)."""

    def __init__(self) -> None:
        self._status: dict[str, ReqStatus] = {}
        self._by_status: dict[ReqStatus, dict[str, Req]] = {s: {} for s in ReqStatus}

    def add(self, req: Req, status: ReqStatus) -> None:
        """Take a new request in `status` (one of `ENTRY`)."""
        if req.rid in self._status:
            raise TransitionError(f"request {req.rid!r} is already in the table")
        if status not in ENTRY:
            raise TransitionError(f"a new request cannot start {status.value}")
        self._put(req, status, front=False)

    def move(self, req: Req, status: ReqStatus, *, front: bool = False) -> None:
        """Change `req`'s status; raises TransitionError for a move `ALLOWED` lacks."""
        current = self._status.get(req.rid)
        if current is None:
            raise TransitionError(f"request {req.rid!r} is not in the table")
        if status not in ALLOWED[current]:
            raise TransitionError(
                f"request {req.rid!r} cannot go from {current.name} to {status.name}"
            )
        del self._by_status[current][req.rid]
        self._put(req, status, front)

    def remove(self, req: Req) -> ReqStatus | None:
        """Take `req` out (it finished); returns the status it had, None if it was not here."""
        status = self._status.pop(req.rid, None)
        if status is not None:
            del self._by_status[status][req.rid]
        return status

    def _put(self, req: Req, status: ReqStatus, front: bool) -> None:
        if status is S.CHUNKED and self._by_status[S.CHUNKED]:
            raise TransitionError("only one request can be partly prefilled at a time")
        queue = self._by_status[status]
        if front:
            self._by_status[status] = {req.rid: req, **queue}
        else:
            queue[req.rid] = req
        self._status[req.rid] = status

    def get(self, rid: str) -> Req | None:
        """The request with id `rid`, None when the table does not hold it."""
        status = self._status.get(rid)
        return None if status is None else self._by_status[status][rid]

    def status(self, req: Req) -> ReqStatus | None:
        """`req`'s status, None when it is not in the table."""
        return self._status.get(req.rid)

    def with_status(self, status: ReqStatus) -> list[Req]:
        """The requests in `status`, in the order they entered it (a copy)."""
        return list(self._by_status[status].values())

    def count(self, status: ReqStatus) -> int:
        return len(self._by_status[status])

    @property
    def chunked(self) -> Req | None:
        """The one partly prefilled request, if any."""
        return next(iter(self._by_status[S.CHUNKED].values()), None)

    def __len__(self) -> int:
        return len(self._status)

    def __iter__(self) -> Iterator[Req]:
        """Every request, status by status (a snapshot: the table may change meanwhile)."""
        return iter([req for queue in self._by_status.values() for req in queue.values()])

    def __contains__(self, req: Req) -> bool:
        return req.rid in self._status
