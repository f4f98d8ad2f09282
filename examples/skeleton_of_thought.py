"""Skeleton of thought: write an outline first, then expand every point in parallel.

Pattern: a short sequential `gen` per outline point, then `fork` one branch per point to expand
them at the same time, and `join("concate_and_append")` to append the expansions to the main
text in order.

Run: python examples/skeleton_of_thought.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import sglite as sgl


@sgl.function
def skeleton_of_thought(s, topic, num_points=2):
    s += f"Topic: {topic}\nOutline in {num_points} short points:\n"
    for i in range(num_points):
        s += f"{i + 1}."
        s += sgl.gen(f"point_{i}", max_tokens=8, stop="\n")
        s += "\n"
    s += "\nDetails:\n"
    branches = s.fork(num_points)
    for i, branch in enumerate(branches):
        branch += f"Point {i + 1}, explained:" + sgl.gen("detail", max_tokens=12) + "\n"
    branches.join("concate_and_append")


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    state = skeleton_of_thought.run(topic="staying healthy", backend=backend, temperature=0)
    if state.error():
        raise state.error()
    print(state.text())
    backend.shutdown()


if __name__ == "__main__":
    main()
