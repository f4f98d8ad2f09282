"""What a sampled token becomes: output ids, logprobs, text, and possibly the request's end.

`OutputProcessor` is where requests finish. `append_token` checks, in this order (the first
that applies wins): the grammar rejecting the token, EOS / `stop_token_ids`, stop strings and
stop regexes on the incremental text, a grammar that allows nothing but EOS, `max_new_tokens`,
and the context length.

Invariants:
- `finish` acts once per request: it sets `finish_reason`, takes the request out of the request
  table, hands its computed tokens to the radix cache (`RequestKVManager.release`) and releases
  its sampling state. A request already finished is left alone, so callers may finish without
  checking first.
- Every request whose client-visible state changed since the last `collect` is in `outbox`
  (`publish` adds one whose state was changed elsewhere).
- `req.output_text` holds no matched stop string unless the request asked for `no_stop_trim`.
"""

from __future__ import annotations

import logging

from sglite.runtime.scheduler.io import AbortKind, FinishReason, RequestOutput, abort_reason
from sglite.runtime.scheduler.kv_manager import RequestKVManager
from sglite.runtime.scheduler.request import Req
from sglite.runtime.scheduler.request_table import RequestTable
from sglite.runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)

# A token's top alternatives as the sampler returns them: [(logprob, token id)].
TopLogprobs = list[tuple[float, int]]


class OutputProcessor:
    """Appends tokens, detects stops, finishes requests and gathers their increments."""

    def __init__(
        self,
        kv: RequestKVManager,
        table: RequestTable,
        eos_token_ids: list[int],
        context_len: int,
        stats: SchedulerStats,
    ) -> None:
        self.kv = kv
        self.table = table
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.stats = stats
        self.outbox: dict[str, Req] = {}

    def append_token(
        self, req: Req, tok: int, logprob: float | None, top: TopLogprobs | None
    ) -> None:
        """Record a new output token of an unfinished request and finish it if it ends here.

        `logprob` is None for a token the model did not choose (retokenizing jump-forward).
        """
        req.output_ids.append(tok)
        req.sampling.on_token(tok)
        self.stats.generated_tokens += 1
        self.outbox[req.rid] = req
        if req.return_logprob:
            req.output_logprobs_pending.append((logprob, tok))
            req.output_top_pending.append(top or [])
        params = req.params
        if req.grammar is not None and not req.grammar.accept_token(tok):
            # The token was sampled under the grammar's own mask (`fill_bitmask` guarantees
            # the two agree): the engine, not the request, is at fault.
            self.abort(
                req,
                f"internal error in constrained decoding: the grammar engine rejected token "
                f"{tok}, which its mask allowed",
                AbortKind.INTERNAL,
            )
        elif (tok in self.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
            if params.no_stop_trim:
                self._push_text(req, tok)
            self.finish(req, {"type": "stop", "matched": tok})
        elif self._push_text(req, tok):
            pass  # a stop string matched and finished the request
        elif req.grammar is not None and req.grammar.is_terminated():
            # Nothing but EOS may follow: the constrained output is complete.
            self.finish(req, {"type": "stop", "matched": self.eos_token_ids[0]})
        elif len(req.output_ids) >= params.max_new_tokens:
            self.finish(req, {"type": "length", "length": params.max_new_tokens})
        elif req.num_fill >= self.context_len:
            self.finish(req, {"type": "length", "length": len(req.output_ids)})

    def _push_text(self, req: Req, tok: int) -> bool:
        """Detokenize `tok`; finish on a stop string. Returns True when a stop matched."""
        before = len(req.output_text)
        req.output_text += req.detokenizer.push([tok])
        match = req.stop_checker.check(req.output_text, before)
        if match is None:
            return False
        if not req.params.no_stop_trim:
            req.output_text = req.output_text[: match.cut]
        self.finish(req, {"type": "stop", "matched": match.matched})
        return True

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End `req` with `reason` (see module invariants); a no-op when it already ended."""
        if req.finished:
            return
        if reason["type"] == "stop" and req.closing_structure:  # closed because of the budget
            reason = {"type": "length", "length": len(req.output_ids)}
        req.finish_reason = reason
        self.table.remove(req)
        if reason["type"] == "length":  # emit bytes held back waiting for a UTF-8 continuation
            req.output_text += req.detokenizer.flush()
        if reason["type"] == "abort":
            self.stats.aborted_requests += 1
        else:
            self.stats.finished_requests += 1
        self.kv.release(req)
        req.sampling.release()
        self.outbox[req.rid] = req

    def abort(self, req: Req, message: str, kind: AbortKind) -> None:
        """Finish `req` with an abort of `kind` naming `message`."""
        self.finish(req, abort_reason(message, kind))

    def fail(self, req: Req, exc: BaseException) -> None:
        """End one request whose own work (grammar, detokenizing, stop check) raised; the rest
        of its batch goes on. Model failures are batch-wide (`Scheduler.fail_all`)."""
        logger.error("request %s failed", req.rid, exc_info=exc)
        message = f"internal error while generating this request: {type(exc).__name__}: {exc}"
        try:
            self.abort(req, message, AbortKind.INTERNAL)
        except Exception:  # its state may be half-updated; answer it anyway
            self.table.remove(req)
            req.finish_reason = abort_reason(message, AbortKind.INTERNAL)
            self.publish(req)

    def publish(self, req: Req) -> None:
        """Send `req`'s state at the next `collect` (for changes made outside this class)."""
        self.outbox[req.rid] = req

    def collect(self) -> list[RequestOutput]:
        """The increments of every request that changed since the last call.

        A non-streamed request past its first token stays in the outbox until it finishes: its
        client needs only the whole answer, and a message per step costs the client process
        CPU time that the step's kernels want on a small machine.
        """
        outs, held = [], {}
        for rid, req in self.outbox.items():
            if req.stream or req.finished or req.sent_token_len == 0:
                outs.append(req.take_output())
            else:
                held[rid] = req
        self.outbox = held
        return outs
