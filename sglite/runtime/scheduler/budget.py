"""KV room for requests' output: what admission keeps free, and retraction when it runs out.

Each running request reserves `ratio x` its remaining new tokens (SGLang's `new_token_ratio`).
The ratio starts at `--init-new-token-ratio`, decays by `--new-token-ratio-decay` per decode
step down to `--min-new-token-ratio` (requests usually stop before their limit), and rises
when a decode step runs out of room (the estimate was too low).

Invariant: a retracted request is first in `WAITING`, holds no KV slot of its own, and keeps
its output tokens (their K/V stays in the radix cache, so its re-admission matches it).
"""

from __future__ import annotations

from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import ReqStatus, RequestTable
from sglite.runtime.scheduler.stats import SchedulerStats
from sglite.runtime.server_args import ServerArgs


class KVBudget:
    """The output reservation over the running requests, and retraction."""

    def __init__(
        self, args: ServerArgs, table: RequestTable, kv: RequestKVManager, stats: SchedulerStats
    ) -> None:
        self.table = table
        self.kv = kv
        self.stats = stats
        self.ratio = args.init_new_token_ratio
        self.min_ratio = args.min_new_token_ratio
        self.decay = args.new_token_ratio_decay

    def reserved_tokens(self) -> int:
        """Slots kept free for the expected output of running requests."""
        pending = sum(r.remaining_new_tokens for r in self.table.with_status(ReqStatus.RUNNING))
        return int(pending * self.ratio)

    def own_reserve(self, req: Req) -> int:
        """What `req` will reserve once it runs."""
        return int(req.remaining_new_tokens * self.ratio)

    def decode_step_done(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def retract(self, req: Req) -> None:
        """Send a running or partly prefilled request back to the front of the queue; its
        computed tokens stay in the cache (see module invariant)."""
        self.stats.retractions += 1
        if not req.input_logprobs_done:  # recomputed from logprob_start_len on re-admission
            req.input_logprobs_pending, req.input_top_pending = [], []
        if req.pooling is not None:  # its prompt is computed again from the cached prefix
            req.pooling = type(req.pooling)(req.pooling.mode)
        self.kv.release(req)  # KV past exact_len (assembled from segments) is dropped...
        req.segments, req.exact_len = [], None  # ... and recomputed exactly on re-admission
        self.table.move(req, ReqStatus.WAITING, front=True)

    def estimate_was_low(self) -> None:
        """Running requests outgrew their reservation (a decode step had to retract)."""
        self.ratio = min(1.0, self.ratio + 0.1)
