"""Routing keys: the part of a request body that decides where its prefix is cached.

The router does not validate requests (the worker does, and its 400 is forwarded as-is), so these
functions accept any JSON value and return no key for a shape they do not recognise; such a
request is routed by load alone.

A batch (a list of prompts) is routed as a whole by its first prompt, and every prompt of it is
then recorded as held by the chosen worker: splitting a batch across workers would mean
splitting per-prompt parameter lists and merging answers and streams, and the batches real
clients send (`select`'s choices, forks) share their prefix anyway.
"""

from __future__ import annotations

from typing import Any

from sglite.load_balancing.radix_tree import Key


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )


def prompt_keys(value: Any) -> list[Key]:
    """Keys of a prompt field: a string, a list of strings, a list of token ids, or a list of
    such lists. Token ids become tuples (they share no tree edge with text)."""
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [tuple(value)]
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(_is_ids(v) for v in value):
            return [tuple(v) for v in value]
    return []


def generate_keys(body: dict[str, Any]) -> list[Key]:
    """Keys of a native /generate body: `text` if given, else `input_ids`."""
    if body.get("text") is not None:
        return prompt_keys(body["text"])
    return prompt_keys(body.get("input_ids"))


def completion_keys(body: dict[str, Any]) -> list[Key]:
    """Keys of an OpenAI /v1/completions body (its `prompt`)."""
    return prompt_keys(body.get("prompt"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def chat_keys(body: dict[str, Any]) -> list[Key]:
    """Key of an OpenAI /v1/chat/completions body: its messages' text contents concatenated.

    Not the rendered prompt (that needs the worker's chat template), but the same messages give
    the same key and a conversation's next turn extends its previous key, which is what
    prefix matching needs.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    text = "".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
    return [text] if text else []
