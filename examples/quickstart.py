"""Quickstart: serve the default model (SmolLM2-135M-Instruct) and answer questions that share a
long few-shot prefix. RadixAttention computes the shared prefix once; the printed cache hit rate
shows how much of the prompts came from the cache.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import time

import sglite

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


def main() -> None:
    """Start the engine, run the batch, print answers and cache statistics."""
    print("loading the default model ...", flush=True)
    with sglite.Engine() as engine:
        prompts = [f"{FEW_SHOT}Q: {q}\nA:" for q in QUESTIONS]
        params = {"temperature": 0, "max_new_tokens": 8, "stop": "\n"}
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        for question, result in zip(QUESTIONS, results):
            meta = result["meta_info"]
            print(
                f"{question:<36} -> {result['text'].strip():<12} "
                f"(prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache)"
            )
        info = engine.get_server_info()
        print(f"\n{len(prompts)} requests in {elapsed:.2f} s")
        print(f"cache hit rate: {info['cache_hit_rate']:.1%} of prompt tokens came from the cache")


if __name__ == "__main__":
    main()
