"""The "ideal" prompt-cache hit rate of a run: what an infinite prefix cache could have reused.

Every model call a system makes is recorded in order (`CallLog`): its prompt text and the text
it produced. Call i could reuse, from a cache that never evicts, the longest prefix of its
prompt that some earlier call j left behind (prompt_j followed by output_j, as a token cache
holds it), but never its last token (its logits must be computed). The ideal hit rate is

    sum_i min(longest prefix match of prompt_i against {prompt_j + output_j : j < i},
              len(prompt_i) - 1) / sum_i len(prompt_i)

in tokens of the model's tokenizer (`ideal_hit_rate` on token ids; `CallLog.ideal_hit_rate` on
the recorded texts). Prompt and output are tokenized separately and concatenated, since a
token cache holds the prompt's ids followed by the generated ids; a later prompt that tokenizes
differently across that boundary loses the tokens after it, as a real cache would.

Native sglite backends are recorded at their transport (`record_native_backend`), so
prefill-only requests (pre-caching, select's prefix probe) count as calls there too: the ideal
then describes the very request stream the runtime's own hit counters saw.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def ideal_hit_rate(calls: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """The ideal hit rate of calls given as (prompt ids, output ids), in call order.

    0.0 when there are no prompt tokens. Uses a token trie of every earlier prompt + output,
    so the cost is linear in the total number of tokens.
    """
    matched, total = ideal_counts(calls)
    return matched / total if total else 0.0


def ideal_counts(calls: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int]:
    """(reusable prompt tokens, all prompt tokens) of `calls`; see `ideal_hit_rate`."""
    root: dict[int, Any] = {}
    matched = total = 0
    for prompt, output in calls:
        node, depth = root, 0
        for tok in prompt:
            child = node.get(tok)
            if child is None:
                break
            node, depth = child, depth + 1
        total += len(prompt)
        matched += max(0, min(depth, len(prompt) - 1))
        node = root
        for tok in list(prompt) + list(output):
            node = node.setdefault(tok, {})
    return matched, total


@dataclass
class Call:
    """One recorded model call. `generated` is False for calls whose `output` is not the model's
    own generation (a scored or forced `select` choice), so it is not counted as output."""

    prompt: str
    output: str = ""
    generated: bool = True


class CallLog:
    """A thread-safe, ordered record of model calls (order = the order calls started)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def start(self, prompt: str, generated: bool = True) -> Call:
        """Record a call as it starts; fill in `.output` when it ends."""
        call = Call(prompt, "", generated)
        with self._lock:
            self.calls.append(call)
        return call

    def add(self, prompt: str, output: str, generated: bool = True) -> None:
        """Record a finished call."""
        self.start(prompt, generated).output = output

    def token_calls(self, encode: Callable[[str], list[int]]) -> list[tuple[list[int], list[int]]]:
        """The calls as (prompt ids, output ids)."""
        cache: dict[str, list[int]] = {}

        def enc(text: str) -> list[int]:
            ids = cache.get(text)
            if ids is None:
                ids = cache[text] = encode(text) if text else []
            return ids

        with self._lock:
            calls = list(self.calls)
        return [(enc(c.prompt), enc(c.output)) for c in calls]

    def ideal_hit_rate(self, encode: Callable[[str], list[int]]) -> float:
        """The ideal hit rate of the recorded calls with this tokenizer's `encode`."""
        return ideal_hit_rate(self.token_calls(encode))

    def output_tokens(self, encode: Callable[[str], list[int]]) -> int:
        """Tokens of all generated texts, re-tokenized (the same count for every system)."""
        with self._lock:
            outputs = [c.output for c in self.calls if c.generated and c.output]
        return sum(len(encode(text)) for text in outputs)


def record_native_backend(
    backend: Any, log: CallLog, decode: Callable[[list[int]], str] | None = None
) -> None:
    """Record every request an sglite `NativeBackend` (Engine or HTTP) sends, into `log`.

    Wraps the instance's `_request`: each prompt of a payload is one call (a prompt given as
    `input_ids` is decoded with `decode`), `n > 1` answers are matched to their prompt in order.
    Calls with `max_new_tokens = 0` (prefill-only) are recorded with an empty output.
    """
    inner = backend._request

    def prompts_of(payload: dict[str, Any]) -> list[str]:
        text = payload.get("text")
        if text is not None:
            return [text] if isinstance(text, str) else list(text)
        ids = payload.get("input_ids") or []
        if ids and isinstance(ids[0], int):
            ids = [ids]
        if decode is None:
            raise ValueError("a request by input_ids needs `decode` to be recorded")
        return [decode(list(x)) for x in ids]

    def request(payload: dict[str, Any]) -> Any:
        calls = [log.start(p) for p in prompts_of(payload)]
        result = inner(payload)
        results = result if isinstance(result, list) else [result]
        per = max(1, len(results) // max(1, len(calls)))
        for i, r in enumerate(results):
            if i // per < len(calls):
                call = calls[i // per]
                if i % per == 0:
                    call.output = r.get("text", "")
                else:  # further n > 1 samples of the same prompt are calls of their own
                    log.add(call.prompt, r.get("text", ""))
        return result

    backend._request = request
