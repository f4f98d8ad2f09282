"""Parallel document summarisation with run_batch and a progress bar.

Pattern: one program per document, run concurrently by `run_batch` (a thread pool); the runtime
batches the requests together (continuous batching) and shares the instruction prefix in its
cache. A document whose program fails would report it in `state.error()` without stopping the
others.

Run: python examples/parallel_summarization.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import sglite as sgl

DOCUMENTS = [
    "The Eiffel Tower was built for the 1889 World's Fair in Paris and is 330 metres tall.",
    "Honey bees live in colonies with one queen, thousands of workers and some drones.",
    "The Pacific is the largest and deepest ocean, covering about a third of the Earth.",
    "Photosynthesis lets plants turn light, water and carbon dioxide into sugar and oxygen.",
]


@sgl.function
def summarize(s, document):
    s += sgl.system("You summarise documents in one short sentence.")
    s += sgl.user("Summarise this document:\n" + document)
    s += sgl.assistant(sgl.gen("summary", max_tokens=16))


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    states = summarize.run_batch(
        [{"document": d} for d in DOCUMENTS], backend=backend, temperature=0, progress_bar=True
    )
    for document, state in zip(DOCUMENTS, states):
        if state.error():
            raise state.error()
        print(f"- {document[:40]}...\n  -> {state['summary'].strip()}")
    backend.shutdown()


if __name__ == "__main__":
    main()
