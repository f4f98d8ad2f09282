"""LLM as a judge: score one answer on several criteria in parallel branches.

Pattern: `fork` one branch per criterion; each branch asks for a verdict with `select` and a short
reason with `gen`; `join()` gathers the verdicts as lists, and plain Python combines them.

Run: python examples/llm_judge.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import sglite as sgl

CRITERIA = ["relevant to the question", "factually correct", "clearly written"]


@sgl.function
def llm_judge(s, question, answer):
    s += "Question: " + question + "\nAnswer: " + answer + "\n"
    branches = s.fork(len(CRITERIA))
    for criterion, branch in zip(CRITERIA, branches):
        branch += f"Is the answer {criterion}? Reply yes or no:"
        branch += sgl.select("verdict", choices=[" yes", " no"])
        branch += ". Reason:" + sgl.gen("reason", max_tokens=10, stop="\n")
    branches.join()
    passed = sum(v.strip() == "yes" for v in s["verdict"])
    s += f"\nOverall: {passed}/{len(CRITERIA)} criteria met."


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    state = llm_judge.run(
        question="What is the capital of France?",
        answer="The capital of France is Paris.",
        backend=backend,
        temperature=0,
    )
    if state.error():
        raise state.error()
    for criterion, verdict, reason in zip(CRITERIA, state["verdict"], state["reason"]):
        print(f"{criterion:<26} {verdict.strip():<4} {reason.strip()}")
    print(state.text().rsplit("\n", 1)[-1])
    backend.shutdown()


if __name__ == "__main__":
    main()
