"""What an OpenAI-compatible endpoint returns, read into sglite's shapes.

`TokenUsage` sums the `usage` of every response of a backend; the helpers read a choice's text
(whole or a stream delta), its finish reason, and its logprobs (completions or chat shape) into
the meta info a native backend would give (`output_token_logprobs`, `output_top_logprobs`,
`finish_reason`, usage). Invariant: everything here only reads responses; nothing calls the
endpoint.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenUsage:
    """What the endpoint reported, summed over every call of the backend (thread-safe).

    `prompt_tokens` and `completion_tokens` are the `usage` of each response (streams ask for
    it with `stream_options.include_usage`); `num_calls` counts API requests that succeeded.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, prompt_tokens: int = 0, completion_tokens: int = 0, calls: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.num_calls += calls

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = self.num_calls = 0

    def snapshot(self) -> TokenUsage:
        """A copy of the counters now."""
        with self._lock:
            return TokenUsage(self.prompt_tokens, self.completion_tokens, self.num_calls)


def choice_text(choice: Any) -> str:
    message = getattr(choice, "message", None)
    if message is not None:
        return message.content or ""
    return choice.text or ""


def delta_text(choice: Any) -> str:
    delta = getattr(choice, "delta", None)
    if delta is not None:
        return delta.content or ""
    return getattr(choice, "text", None) or ""


def finish_meta(choice: Any) -> dict[str, Any]:
    return {"type": choice.finish_reason, "matched": getattr(choice, "matched_stop", None)}


def usage_meta(usage: Any) -> dict[str, Any]:
    meta = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and getattr(details, "cached_tokens", None) is not None:
        meta["cached_tokens"] = details.cached_tokens
    return meta


def response_meta(response: Any, choice: Any, with_logprobs: bool = True) -> dict[str, Any]:
    """Meta info of one choice, shaped like the native `meta_info` (usage is the response's)."""
    meta: dict[str, Any] = {"id": response.id, "finish_reason": finish_meta(choice)}
    if getattr(response, "usage", None) is not None:
        meta.update(usage_meta(response.usage))
    entries = _logprob_entries(choice) if with_logprobs else None
    if entries is not None:
        meta["output_token_logprobs"], tops = entries
        if any(tops):
            meta["output_top_logprobs"] = tops
    return meta


def token_pieces(choice: Any) -> list[str] | None:
    """The choice's tokens as text (from its logprobs), or None."""
    entries = _logprob_entries(choice)
    return None if entries is None else [e[2] for e in entries[0]]


def _logprob_entries(choice: Any) -> tuple[list[list[Any]], list[Any]] | None:
    """`[logprob, None, token]` per output token and the top alternatives per position, from
    either the completions or the chat logprobs shape; None without logprobs."""
    logprobs = getattr(choice, "logprobs", None)
    if logprobs is None:
        return None
    content = getattr(logprobs, "content", None)
    if content is not None:  # chat
        entries = [[t.logprob, None, t.token] for t in content]
        tops = [[[x.logprob, None, x.token] for x in (t.top_logprobs or [])] for t in content]
        return entries, tops
    tokens = getattr(logprobs, "tokens", None)
    if tokens is None:
        return None
    values = list(logprobs.token_logprobs or [None] * len(tokens))
    entries = [[lp, None, tok] for lp, tok in zip(values, tokens)]
    tops = [
        [[lp, None, tok] for tok, lp in (top or {}).items()]
        for top in (logprobs.top_logprobs or [None] * len(tokens))
    ]
    return entries, tops
