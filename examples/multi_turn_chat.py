"""Multi-turn chat: roles rendered with the model's own chat template.

Pattern: `sgl.user(...)` / `sgl.assistant(sgl.gen(...))` expressions and the equivalent
`with s.user():` blocks. Generations inside an assistant turn stop at the template's end-of-turn
string; `s.messages()` returns the conversation in the OpenAI format. The second turn reuses the
cached first turn (prompt and answer).

Run: python examples/multi_turn_chat.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import sglite as sgl


@sgl.function
def multi_turn_chat(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=16))
    with s.user():
        s += question_2
    with s.assistant():
        s += sgl.gen("answer_2", max_tokens=16)


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    state = multi_turn_chat.run(
        question_1="What is the capital of France?",
        question_2="And what is its most famous tower?",
        backend=backend,
        temperature=0,
    )
    if state.error():
        raise state.error()
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    meta = state.get_meta_info("answer_2")
    print(f"\nsecond turn: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached")
    backend.shutdown()


if __name__ == "__main__":
    main()
