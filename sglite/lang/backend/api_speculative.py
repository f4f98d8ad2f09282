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

Modules: this one holds the per-state entry point (`ApiSpeculation`) and what a backend
provides (`SpeculativeBackend`); `api_speculative_reply.py` the replies and where a gen ends in
them (`SpecReply`, `find_cut`, `is_speculable`); `api_speculative_completion.py` and
`api_speculative_chat.py` the two modes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sglite.lang.backend.api_speculative_chat import ChatSpeculation
from sglite.lang.backend.api_speculative_completion import CompletionSpeculation
from sglite.lang.backend.api_speculative_reply import SpecReply
from sglite.lang.ir import SglExpr, SglExprList
from sglite.lang.sampling_params import SglSamplingParams

if TYPE_CHECKING:
    from sglite.lang.stream_executor import StreamExecutor

DEFAULT_MAX_TRIES = 3


# ============================================================================ the backend side
class SpeculativeBackend(Protocol):
    """What a backend provides for speculative execution."""

    is_chat_model: bool

    def spec_call(self, s: StreamExecutor, params: SglSamplingParams, max_tokens: int) -> SpecReply:
        """One call continuing `s` (its text, or its messages and open assistant turn) with
        `params`' sampling settings, no stop strings and `max_tokens` tokens."""
        ...


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
