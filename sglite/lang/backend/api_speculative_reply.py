"""What API speculation serves gens from: a speculative call's reply and where a gen ends in it.

`SpecReply` is one call's answer (text, per-token ends, whether the model ended it); `find_cut`
places a `gen`'s end in it exactly where the gen's own request would have ended (its first stop
string, its `max_tokens`-th token, or the model's end), and returns None when the reply does not
tell. Which gens may be cut out of a longer generation at all is decided by `is_speculable` and
`sampling_key`. Both speculation modes (`api_speculative_completion.py`,
`api_speculative_chat.py`) build on these; the rules are in `api_speculative.py`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sglite.lang.sampling_params import SglSamplingParams


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


# ============================================================================ serving
def stop_strings(params: SglSamplingParams) -> list[str]:
    return [s for s in params.stop_list() if s]


def cut_meta(reply: SpecReply, cut: Cut, called: bool) -> dict[str, Any]:
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
