"""Few-shot QA with run_batch: many questions share one long few-shot prefix.

Pattern: constant text first, then the arguments. `run_batch` traces the program, sends the
shared prefix to the cache once before the batch, and then every question reuses it
(`cached_tokens` in each answer's meta info).

Run: python examples/few_shot_qa.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import sglite as sgl

FEW_SHOT = """Answer each question with one word.
Q: What is the capital of France?
A: Paris
Q: What is the capital of Italy?
A: Rome
Q: What is the capital of Spain?
A: Madrid
"""


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=6, stop="\n")


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    questions = [
        "What is the capital of Germany?",
        "What is the capital of Japan?",
        "What is the capital of Egypt?",
    ]
    states = few_shot_qa.run_batch(
        [{"question": q} for q in questions], backend=backend, temperature=0, progress_bar=True
    )
    for question, state in zip(questions, states):
        if state.error():
            raise state.error()
        meta = state.get_meta_info("answer")
        print(f"{question} -> {state['answer'].strip()!r} ({meta['cached_tokens']} cached tokens)")
    backend.shutdown()


if __name__ == "__main__":
    main()
