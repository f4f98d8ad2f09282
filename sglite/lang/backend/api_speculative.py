"""API speculative execution: fewer calls for multi-`gen` programs on API-only models.

`@sgl.function(num_api_spec_tokens=N)` on a backend that supports it (`sgl.OpenAI`) gives each
program state an `ApiSpeculation` (held by the interpreter as `StreamExecutor.api_spec`), which
sees every expression before the interpreter runs it (`intercept`).

**Completion models** (`CompletionSpeculation`): a `gen` asks for `max(N, max_tokens)` tokens
*without its stop strings* and keeps the reply. Its value is the reply cut where the real
request would have ended (the first stop string, `max_tokens` tokens, or the model's own end);
the rest is kept as the speculation. Text appended afterwards (constants, select decisions,
role text ...) is compared with the speculation lazily, at the next `gen`: if it is a prefix of
the speculation, it is consumed and that `gen` is cut from what remains, without a call; if
not, the speculation is dropped and the `gen` makes a new call. A `gen` the speculation cannot
answer (no stop string in it and fewer than `max_tokens` tokens left) makes a new call too.

**Chat models** (`ChatSpeculation`): inside an assistant turn, constant text and `gen`s are
recorded instead of run. When the turn ends (or something needs its text: a read of one of its
variables, `text()`, a fork, the program's end), one call generates the whole turn, and the
reply is matched against the recorded template: each text must appear verbatim where it falls,
each `gen` takes the reply up to its stop. The longest matching prefix of the template is
accepted; after a mismatch the unmatched text is appended and the next call continues the
partial assistant message; once `max_tries` calls are spent (or fewer than two gens remain) the
rest falls back to one call per `gen`. While sampling, a call that did not match everything may
be repeated from the same point (greedy calls would only repeat themselves).

Invariant (both modes): a value served from a speculation is the text the endpoint would have
returned to the `gen`'s own request, whenever the model, given the program's text so far,
would have generated the speculated text; in particular under greedy decoding the values equal
those of a run without speculation, up to how the endpoint tokenizes the prompt at the point
where constant text meets generated text. Only `gen`s whose result depends on nothing but the
text so far are speculated (`is_speculable`); the others run as usual and drop the speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sglite.lang.ir import (
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglSamplingParams,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
)

if TYPE_CHECKING:
    from sglite.lang.stream_executor import StreamExecutor

logger = logging.getLogger(__name__)

DEFAULT_MAX_TRIES = 3


# ============================================================================ data
@dataclass
class SpecReply:
    """One speculative API call's answer.

    `text` is the generated text; `finished` is True when the model ended it itself (no stop
    string was sent, so this is its end-of-sequence) rather than at the token limit;
    `token_ends[i]` is the character offset in `text` where token `i` ends (None when the
    endpoint did not return per-token text); `max_tokens` is the limit the call was made with;
    `meta` is the call's meta info (id, usage).
    """

    text: str
    finished: bool
    token_ends: list[int] | None
    max_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cut:
    """Where a `gen` starting at `start` in a reply ends: its value is `text[start:end]`.

    `finish_reason` is what the endpoint would have reported ("stop" or "length"), `matched`
    the stop string that ended it (None for the model's end or a length cut).
    """

    start: int
    end: int
    finish_reason: str
    matched: str | None
    num_tokens: int | None


def find_cut(
    reply: SpecReply, start: int, stops: Sequence[str], max_tokens: int | None
) -> Cut | None:
    """Where a `gen` with these `stops` and `max_tokens`, starting at `start`, ends in `reply`;
    None when the reply does not tell (the gen would go on past the reply's end).

    A stop string ends the gen at the token where it is complete, so among several the one
    completed first wins (as a server checking after every token decides), its text excluded.
    Token counts need `token_ends`; without them a stop string is trusted wherever it is, and a
    gen without one is only cut when the call was made with exactly its `max_tokens`.
    """
    text = reply.text
    ends = reply.token_ends
    own_ends = None if ends is None else [e for e in ends if e > start]
    limit = None  # where the gen's max_tokens-th token ends, if the reply gets that far
    if own_ends is not None and max_tokens is not None and len(own_ends) >= max_tokens:
        limit = own_ends[max_tokens - 1] if max_tokens > 0 else start

    best: tuple[int, int, str] | None = None  # (completed at, starts at, stop)
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos != -1:
            candidate = (pos + len(stop), pos, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate

    def count(end: int) -> int | None:
        # Tokens overlapping text[start:end]: own token k starts where own token k-1 ends.
        if own_ends is None:
            return None
        if end <= start:
            return 0
        return min(len(own_ends), 1 + sum(1 for e in own_ends if e < end))

    if best is not None and (limit is None or best[0] <= limit):
        return Cut(start, best[1], "stop", best[2], count(best[1]))
    if limit is not None:
        return Cut(start, limit, "length", None, max_tokens)
    if reply.finished:
        return Cut(start, len(text), "stop", None, count(len(text)))
    if ends is None and start == 0 and max_tokens == reply.max_tokens:
        return Cut(start, len(text), "length", None, max_tokens)
    return None


def token_ends_from_pieces(text: str, pieces: Sequence[str] | None) -> list[int] | None:
    """Cumulative end offsets of `pieces` (the reply's tokens as text), or None when they do
    not spell `text` exactly (byte-level pieces of multi-byte characters, missing logprobs)."""
    if pieces is None or "".join(pieces) != text:
        return None
    ends, pos = [], 0
    for piece in pieces:
        pos += len(piece)
        ends.append(pos)
    return ends


# ============================================================================ eligibility
def is_speculable(params: SglSamplingParams) -> bool:
    """Whether a gen's result depends only on the text before it, so it may be cut out of a
    longer generation: one sample, no constraint, no logprobs asked, no penalties (they count
    the call's own earlier tokens), no stop tokens or regexes, no minimum length."""
    return (
        (params.n or 1) == 1
        and params.dtype is None
        and params.regex is None
        and params.json_schema is None
        and not params.return_logprob
        and not params.stop_token_ids
        and not params.stop_regex
        and not params.ignore_eos
        and not params.min_new_tokens
        and not params.frequency_penalty
        and not params.presence_penalty
        and params.max_new_tokens is not None
    )


def sampling_key(params: SglSamplingParams) -> tuple[Any, ...]:
    """The parameters a speculation was sampled with; only gens with the same key may be served
    from it."""
    return (params.temperature, params.top_p, params.top_k, params.min_p)


def is_greedy(params: SglSamplingParams) -> bool:
    return params.temperature is not None and params.temperature <= 1e-5


# ============================================================================ the backend side
class SpeculativeBackend(Protocol):
    """What a backend provides for speculative execution."""

    is_chat_model: bool

    def spec_call(self, s: StreamExecutor, params: SglSamplingParams, max_tokens: int) -> SpecReply:
        """One call continuing `s` (its text, or its messages and open assistant turn) with
        `params`' sampling settings, no stop strings and `max_tokens` tokens."""
        ...


def _stops(params: SglSamplingParams) -> list[str]:
    return [s for s in params.stop_list() if s]


def _meta(reply: SpecReply, cut: Cut, called: bool) -> dict[str, Any]:
    """Meta info of a gen served from a speculation (usage belongs to the gen that called)."""
    meta: dict[str, Any] = {
        "finish_reason": {"type": cut.finish_reason, "matched": cut.matched},
        "completion_tokens": cut.num_tokens,
        "speculative": True,
        "api_call": called,
    }
    if called:
        meta.update({k: v for k, v in reply.meta.items() if k != "finish_reason"})
        meta["completion_tokens"] = cut.num_tokens
        meta["call_completion_tokens"] = reply.meta.get("completion_tokens")
    return meta


# ============================================================================ per-state object
class ApiSpeculation:
    """One program state's speculative execution (see the module doc).

    `intercept(s, expr)` is called by the interpreter's worker for every expression before it
    runs; True means the expression was handled (or deferred) here. `defers` says whether work
    can be deferred (chat models), in which case the interpreter submits an `SglCommitLazy`
    before it waits on a variable or reads the text, and at the program's end, so deferred
    work always runs.
    """

    def __init__(
        self,
        backend: SpeculativeBackend,
        num_api_spec_tokens: int,
        max_tries: int = DEFAULT_MAX_TRIES,
    ) -> None:
        if num_api_spec_tokens < 1:
            raise ValueError(f"num_api_spec_tokens must be >= 1, got {num_api_spec_tokens}")
        self.backend = backend
        self.num_tokens = int(num_api_spec_tokens)
        self.max_tries = max(1, int(max_tries))
        self._completion = CompletionSpeculation(self)
        self._chat = ChatSpeculation(self)

    @property
    def defers(self) -> bool:
        return bool(self.backend.is_chat_model)

    def intercept(self, s: StreamExecutor, expr: SglExpr) -> bool:
        if isinstance(expr, SglExprList):
            return False  # the interpreter recurses; each element comes back here
        if self.backend.is_chat_model:
            return self._chat.intercept(s, expr)
        return self._completion.intercept(s, expr)


class CompletionSpeculation:
    """Completion-model speculation: the reply of the last call and where it starts in the
    program's text (`base`). Invariant: `reply is None` or `s.text_[base:]` was, when last
    checked, a prefix of `reply.text` (text is only compared lazily, at the next gen)."""

    def __init__(self, owner: ApiSpeculation) -> None:
        self.owner = owner
        self.reply: SpecReply | None = None
        self.base = 0
        self.key: tuple[Any, ...] | None = None

    def intercept(self, s: StreamExecutor, expr: SglExpr) -> bool:
        if not isinstance(expr, SglGen):
            return False  # appended text is matched lazily, at the next gen
        params = s._resolve_sampling_params(expr.sampling_params)
        if not is_speculable(params):
            self.reply = None
            return False
        served = self._serve(s, params)
        called = served is None
        if served is None:
            reply = self.owner.backend.spec_call(
                s, params, max(self.owner.num_tokens, int(params.max_new_tokens))
            )
            self.reply, self.base, self.key = reply, len(s.text_), sampling_key(params)
            cut = find_cut(reply, 0, _stops(params), params.max_new_tokens)
            if cut is None:  # cannot place the gen's end in the reply: run it as usual
                self.reply = None
                return False
            served = (reply, cut)
        reply, cut = served
        value = reply.text[cut.start : cut.end]
        s._fill(value)
        s._store(expr.name, value, _meta(reply, cut, called))
        return True

    def _serve(self, s: StreamExecutor, params: SglSamplingParams) -> tuple[SpecReply, Cut] | None:
        reply = self.reply
        if reply is None or self.key != sampling_key(params):
            return None
        appended = s.text_[self.base :]
        if not reply.text.startswith(appended):
            self.reply = None  # the program wrote something the model did not
            return None
        cut = find_cut(reply, len(appended), _stops(params), params.max_new_tokens)
        if cut is None:
            self.reply = None
        return None if cut is None else (reply, cut)


# ---------------------------------------------------------------------------- chat
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
            cut = find_cut(reply, pos, _stops(item.params), item.params.max_new_tokens)
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
                    s._store(item.expr.name, value, _meta(reply, cut, called=first_gen))
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
