"""API speculation for chat models (`ChatSpeculation`): one call per assistant turn.

Inside an assistant turn, constant text and `gen`s are recorded as items instead of run; when
something needs the turn's text, one call generates the whole turn and `match_turn` accepts the
longest prefix of the items the reply matches (texts verbatim, each gen up to where its own
request would have ended); the rest is retried or run one call per gen (the rules are in
`api_speculative.py`'s docstring). Invariant: recorded items run exactly once, in order, either
served from a reply or run plainly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglite.lang.backend.api_speculative_reply import (
    Cut,
    SpecReply,
    cut_meta,
    find_cut,
    is_greedy,
    is_speculable,
    sampling_key,
    stop_strings,
)
from sglite.lang.ir import (
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglGen,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
)
from sglite.lang.sampling_params import SglSamplingParams

if TYPE_CHECKING:
    from sglite.lang.backend.api_speculative import ApiSpeculation
    from sglite.lang.stream_executor import StreamExecutor

logger = logging.getLogger(__name__)


@dataclass
class _Text:
    text: str


@dataclass
class _Gen:
    expr: SglGen
    params: SglSamplingParams


@dataclass
class _Other:
    """An expression that neither adds text nor generates (a variable scope): replayed."""

    expr: SglExpr


_Item = _Text | _Gen | _Other


@dataclass
class TurnMatch:
    """How much of a recorded window a reply matched: its first `accepted` items, with the
    cut of each accepted gen (keyed by `id(item)`)."""

    accepted: int
    cuts: dict[int, Cut]


def match_turn(reply: SpecReply, items: Sequence[_Item]) -> TurnMatch:
    """Match `reply` against recorded items: texts verbatim, gens up to where their own
    request would have ended (`find_cut`)."""
    pos = 0
    cuts: dict[int, Cut] = {}
    for i, item in enumerate(items):
        if isinstance(item, _Text):
            if not reply.text.startswith(item.text, pos):
                return TurnMatch(i, cuts)
            pos += len(item.text)
        elif isinstance(item, _Gen):
            cut = find_cut(reply, pos, stop_strings(item.params), item.params.max_new_tokens)
            if cut is None:
                return TurnMatch(i, cuts)
            cuts[id(item)] = cut
            pos = cut.end
    return TurnMatch(len(items), cuts)


class ChatSpeculation:
    """Chat-model speculation: the items of the open assistant turn not yet run."""

    def __init__(self, owner: ApiSpeculation) -> None:
        self.owner = owner
        self.items: list[_Item] = []
        self._replaying = False

    def intercept(self, s: StreamExecutor, expr: SglExpr) -> bool:
        if self._replaying or s.cur_role != "assistant":
            return False
        if isinstance(expr, SglConstantText):
            self.items.append(_Text(expr.value))
            return True
        if isinstance(expr, SglVariable):
            self.items.append(_Text(str(expr.source.get_var(expr.name))))
            return True
        if isinstance(expr, SglGen):
            self.items.append(_Gen(expr, s._resolve_sampling_params(expr.sampling_params)))
            return True
        if isinstance(expr, (SglVarScopeBegin, SglVarScopeEnd)):
            self.items.append(_Other(expr))
            return True
        # Anything else (the turn's end, a flush request, a select ...) needs the text so far.
        self.flush(s)
        return isinstance(expr, SglCommitLazy)  # a flush request is done; the rest still runs

    def flush(self, s: StreamExecutor) -> None:
        """Run the recorded items (see `_run`)."""
        items, self.items = self.items, []
        if not items:
            return
        self._replaying = True
        try:
            self._run(s, items)
        finally:
            self._replaying = False

    def _run(self, s: StreamExecutor, items: list[_Item]) -> None:
        """Speculate over windows of at least two compatible gens, accept what each reply
        matches, and run the rest as it is: text appended, gens one call each.

        The first call starts at the segment's start, so the model must write the leading text
        itself (an endpoint that cannot continue a partial message, such as OpenAI's, still
        gets one call per turn). After a mismatch the unmatched text is appended first and the
        next call continues the partial message. At most `max_tries` speculative calls are made
        per segment; under greedy decoding a call is never repeated from the same point.
        """
        pos, calls, called_before = 0, 0, False
        while pos < len(items):
            end = _speculable_window(items, pos)
            if end is None or calls >= self.owner.max_tries:
                self._run_plain(s, items[pos])
                pos += 1
                continue
            if called_before:  # what the model did not write goes into the prompt
                while not isinstance(items[pos], _Gen):
                    self._run_plain(s, items[pos])
                    pos += 1
            window = items[pos:end]
            reply, turn, used = self._best_reply(s, window, self.owner.max_tries - calls)
            calls += used
            called_before = True
            first_gen = True
            for item in window[: turn.accepted]:
                if isinstance(item, _Gen):
                    cut = turn.cuts[id(item)]
                    value = reply.text[cut.start : cut.end]
                    s._fill(value)
                    s._store(item.expr.name, value, cut_meta(reply, cut, called=first_gen))
                    first_gen = False
                else:
                    self._run_plain(s, item)
            pos += turn.accepted
            if turn.accepted == 0 and isinstance(items[pos], _Gen):
                self._run_plain(s, items[pos])  # the reply ended before this gen could
                pos += 1

    def _best_reply(
        self, s: StreamExecutor, window: list[_Item], budget: int
    ) -> tuple[SpecReply, TurnMatch, int]:
        """The reply (of up to `budget` calls; one when greedy) matching most of `window`."""
        gens = [item for item in window if isinstance(item, _Gen)]
        params = gens[0].params
        max_tokens = max(self.owner.num_tokens, *(int(g.params.max_new_tokens) for g in gens))
        tries = 1 if is_greedy(params) else max(1, budget)
        best: tuple[SpecReply, TurnMatch] | None = None
        used = 0
        for _ in range(tries):
            reply = self.owner.backend.spec_call(s, params, max_tokens)
            used += 1
            turn = match_turn(reply, window)
            if best is None or turn.accepted > best[1].accepted:
                best = (reply, turn)
            if turn.accepted == len(window):
                break
        assert best is not None
        if best[1].accepted < len(window):
            logger.debug("speculative turn matched %d of %d items", best[1].accepted, len(window))
        return best[0], best[1], used

    def _run_plain(self, s: StreamExecutor, item: _Item) -> None:
        if isinstance(item, _Text):
            s._fill(item.text)
        elif isinstance(item, _Gen):
            s._execute_gen(item.expr)
        else:
            s._execute(item.expr)


def _speculable_window(items: Sequence[_Item], pos: int) -> int | None:
    """The end of the longest run of items from `pos` whose gens may share one call (all
    speculable, same sampling settings), or None when it holds fewer than two gens (one gen
    needs one call either way, and its own request, with its stops, is exact)."""
    key = None
    num_gens = 0
    end = pos
    while end < len(items):
        item = items[end]
        if isinstance(item, _Gen):
            if not is_speculable(item.params):
                break
            if key is None:
                key = sampling_key(item.params)
            elif sampling_key(item.params) != key:
                break
            num_gens += 1
        end += 1
    return end if num_gens >= 2 else None
