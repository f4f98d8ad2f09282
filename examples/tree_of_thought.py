"""Tree of thought: branch into several lines of reasoning, then judge each branch.

Pattern: `s.fork(n)` runs the branches in parallel (the shared question is prefilled once, so
every branch starts from the cache); each branch mixes `gen` (a thought) and `select` (a verdict);
`join()` gathers each branch's variables into lists on the parent state.

Run: python examples/tree_of_thought.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import sglite as sgl


@sgl.function
def tree_of_thought(s, question, num_branches=2):
    s += "Question: " + question + "\n"
    branches = s.fork(num_branches)
    branches += lambda i: f"Idea {i + 1}:"
    branches += sgl.gen("thought", max_tokens=12, stop="\n", temperature=0.8)
    branches += "\nIs this idea useful? Answer:"
    branches += sgl.select("verdict", choices=[" yes", " no"])
    branches.join()


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    state = tree_of_thought.run(question="How can I save water at home?", backend=backend)
    if state.error():
        raise state.error()
    for i, (thought, verdict) in enumerate(zip(state["thought"], state["verdict"])):
        print(f"branch {i + 1}: {thought.strip()!r} -> useful:{verdict}")
    cached = [m["cached_tokens"] for m in state.get_meta_info("thought")]
    print(f"cached tokens per branch: {cached}")
    backend.shutdown()


if __name__ == "__main__":
    main()
