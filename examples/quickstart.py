"""Quickstart: start `sglite serve` on the default model (SmolLM2-135M-Instruct) and run an LM
program against it over HTTP.

The program answers questions that share a long few-shot prefix. RadixAttention computes the
prefix once; the printed cache hit rate shows how much of the prompts came from the cache.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import time

import sglite as sgl

FEW_SHOT = """You answer geography questions with one word.
Q: What is the capital of France?
A: Paris
Q: What is the capital of Italy?
A: Rome
Q: What is the capital of Spain?
A: Madrid
Q: What is the capital of Germany?
A: Berlin
"""

QUESTIONS = [
    "What is the capital of Japan?",
    "What is the capital of Egypt?",
    "What is the capital of Canada?",
    "What is the capital of Portugal?",
    "What is the capital of Greece?",
    "What is the capital of Norway?",
]


@sgl.function
def capital_quiz(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    """Start the server, run the batch of programs, print answers and cache statistics."""
    print("starting `sglite serve` on the default model ...", flush=True)
    runtime = sgl.Runtime()  # a real HTTP server in a child process
    try:
        print(f"server listening at {runtime.url}", flush=True)
        sgl.set_default_backend(runtime)
        start = time.perf_counter()
        states = capital_quiz.run_batch(
            [{"question": q} for q in QUESTIONS], temperature=0, progress_bar=False
        )
        elapsed = time.perf_counter() - start
        for question, state in zip(QUESTIONS, states):
            meta = state.get_meta_info("answer")
            print(
                f"{question:<36} -> {state['answer'].strip():<12} "
                f"(prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache)"
            )
        info = sgl.get_server_info()
        print(f"\n{len(QUESTIONS)} programs in {elapsed:.2f} s")
        print(f"cache hit rate: {info['cache_hit_rate']:.1%} of prompt tokens came from the cache")
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
