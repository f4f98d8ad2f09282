"""`select` over an OpenAI-style completions API, two ways.

- **Echoed logprobs** (`select_by_echo_logprobs`): one request scores `prefix + choice` for
  every choice (`echo=True, logprobs=0, max_tokens=0`); a choice's tokens are those that end
  after the prefix, so the prefix's last token counts when the choice was tokenized together
  with it (as the native backends decide). The choice method (`sglite.lang.choices`) then
  decides exactly as it does natively. sglite's and SGLang's servers, vLLM and older OpenAI
  models answer such requests.
- **Logit bias** (`select_by_logit_bias`, SGLang's method for OpenAI): token by token, a
  one-token greedy request with a +100 bias on the next token of every choice still in the
  race; the choices whose token the model picked stay in. Needs the model's tokenizer and an
  endpoint that takes `logit_bias`; scores are numbers of matched tokens, not logprobs.

`complete(**kwargs)` is the backend's completions call (it adds the model and counts usage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sglite.lang.choices import ChoicesDecision, ChoicesSamplingMethod

Complete = Callable[..., Any]


class NoLogprobs(RuntimeError):
    """The endpoint answered without the logprobs asked for."""


def _sorted_choices(response: Any) -> list[Any]:
    return sorted(response.choices, key=lambda c: c.index)


def echo_entries(choice: Any) -> list[tuple[int, list[Any]]]:
    """`(start offset, [logprob, None, token text])` of every token of an echoed completion
    choice; offsets come from `text_offset`, else from the tokens' lengths."""
    logprobs = choice.logprobs
    if logprobs is None or not logprobs.tokens:
        raise NoLogprobs("the endpoint returned no logprobs for an echoed prompt")
    tokens = list(logprobs.tokens)
    values = list(logprobs.token_logprobs or [None] * len(tokens))
    offsets = list(logprobs.text_offset or [])
    if len(offsets) != len(tokens):
        offsets, pos = [], 0
        for token in tokens:
            offsets.append(pos)
            pos += len(token)
    return [(off, [lp, None, tok]) for off, lp, tok in zip(offsets, values, tokens)]


def choice_entries(entries: Sequence[tuple[int, list[Any]]], prefix_len: int) -> list[list[Any]]:
    """The entries of the choice's own tokens: those ending after the prefix (a token that
    straddles the boundary merged the prefix's end with the choice). Null logprobs (the first
    token of an empty prefix) never count."""
    own = [e for off, e in entries if off + len(e[2] or "") > prefix_len]
    return [e for e in own if e[0] is not None]


def _mean(entries: Sequence[list[Any]]) -> float:
    values = [float(e[0]) for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


def select_by_echo_logprobs(
    complete: Complete,
    prefix: str,
    choices: list[str],
    method: ChoicesSamplingMethod,
) -> ChoicesDecision:
    """Score each choice by its tokens' logprobs after `prefix` (one batched request) and let
    `method` decide. Raises NoLogprobs when the endpoint does not return them."""
    response = complete(
        prompt=[prefix + c for c in choices], max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    answers = _sorted_choices(response)
    if len(answers) != len(choices):
        raise NoLogprobs(f"{len(answers)} answers for {len(choices)} prompts")
    conditional = [choice_entries(echo_entries(a), len(prefix)) for a in answers]
    if any(not entries for entries in conditional):
        raise NoLogprobs("a choice got no token logprobs")
    unconditional = None
    if method.requires_unconditional_logprobs:
        texts = ["".join(e[2] or "" for e in entries) for entries in conditional]
        uncond = _sorted_choices(
            complete(prompt=texts, max_tokens=0, echo=True, logprobs=0, temperature=0)
        )
        unconditional = [
            _aligned([e for _, e in echo_entries(a)], len(cond))
            for a, cond in zip(uncond, conditional)
        ]
    return method(
        choices=choices,
        normalized_prompt_logprobs=[_mean(entries) for entries in conditional],
        input_token_logprobs=conditional,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )


def _aligned(entries: list[list[Any]], length: int) -> list[list[Any]]:
    """Unconditional entries with one per conditional token. Alone, a choice may tokenize
    differently than after the prefix; then every position gets the mean logprob (the first
    token, without context, counting 0), which keeps mean(conditional - unconditional)."""
    if len(entries) == length:
        return entries
    values = [0.0 if e[0] is None else float(e[0]) for e in entries]
    mean = sum(values) / len(values) if values else 0.0
    return [[mean, None, None] for _ in range(length)]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (Hugging Face or tiktoken tokenizers)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def select_by_logit_bias(
    complete: Complete, tokenizer: Any, prefix: str, choices: list[str]
) -> ChoicesDecision:
    """SGLang's token-by-token method: at each step one greedy token with +100 on the next
    token of every choice still matching; the choice matching the most tokens wins (the
    first on ties)."""
    ids = [encode(tokenizer, c) for c in choices]
    prompt = encode(tokenizer, prefix)
    alive = [bool(x) for x in ids]
    scores = [0] * len(choices)
    step = 0
    while sum(alive) > 1:
        bias = {str(ids[i][step]): 100 for i in range(len(choices)) if alive[i]}
        response = complete(
            prompt=prompt or [tokenizer_bos(tokenizer)],
            max_tokens=1,
            temperature=0,
            logit_bias=bias,
        )
        text = _sorted_choices(response)[0].text
        picked = None
        for i in range(len(choices)):
            if not alive[i]:
                continue
            if tokenizer.decode([ids[i][step]]) == text:
                scores[i] += 1
                picked = ids[i][step]
            else:
                alive[i] = False
            if step == len(ids[i]) - 1:
                alive[i] = False
        if picked is None:  # the endpoint ignored the bias: no more information
            break
        prompt = prompt + [picked]
        step += 1
    best = max(range(len(choices)), key=lambda i: (scores[i], -i))
    return ChoicesDecision(choices[best], {"scores": scores, "method": "logit_bias"})


def tokenizer_bos(tokenizer: Any) -> int:
    """A token to prompt with when the prefix is empty (the BOS token, else token 0)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return int(bos) if bos is not None else 0
