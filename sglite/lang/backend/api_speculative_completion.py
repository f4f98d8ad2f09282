"""API speculation for completion models (`CompletionSpeculation`).

A `gen` asks for `max(N, max_tokens)` tokens without its stop strings and keeps the reply;
later gens are cut from it while the program's text stays a prefix of it (the rules are in
`api_speculative.py`'s docstring). Invariant: `reply is None` or `s.text_[base:]` was, when last
checked, a prefix of `reply.text`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglite.lang.backend.api_speculative_reply import (
    Cut,
    SpecReply,
    cut_meta,
    find_cut,
    is_speculable,
    sampling_key,
    stop_strings,
)
from sglite.lang.ir import SglExpr, SglGen
from sglite.lang.sampling_params import SglSamplingParams

if TYPE_CHECKING:
    from sglite.lang.backend.api_speculative import ApiSpeculation
    from sglite.lang.stream_executor import StreamExecutor


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
            cut = find_cut(reply, 0, stop_strings(params), params.max_new_tokens)
            if cut is None:  # cannot place the gen's end in the reply: run it as usual
                self.reply = None
                return False
            served = (reply, cut)
        reply, cut = served
        value = reply.text[cut.start : cut.end]
        s._fill(value)
        s._store(expr.name, value, cut_meta(reply, cut, called))
        return True

    def _serve(self, s: StreamExecutor, params: SglSamplingParams) -> tuple[SpecReply, Cut] | None:
        reply = self.reply
        if reply is None or self.key != sampling_key(params):
            return None
        appended = s.text_[self.base :]
        if not reply.text.startswith(appended):
            self.reply = None  # the program wrote something the model did not
            return None
        cut = find_cut(reply, len(appended), stop_strings(params), params.max_new_tokens)
        if cut is None:
            self.reply = None
        return None if cut is None else (reply, cut)
