"""bench_segments' workload: the pool of company documents, the requests (a question about one
of 4-6 documents, the documents in two orders) and their prompts' token ids with the documents'
spans as segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.programs.common import rng_for
from benchmarks.programs.rag import QUESTIONS, company_facts, company_passages

HEADER = "Answer from the documents.\n"


@dataclass(frozen=True)
class Request:
    """One question about one of its documents, with its documents in two orders."""

    docs_warm: tuple[int, ...]
    docs_measured: tuple[int, ...]
    question: str


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    spans: list[list[int]]  # the documents' token spans [start, end)


@dataclass
class Workload:
    docs: list[str]
    requests: list[Request]
    warm: list[Prompt] = field(default_factory=list)
    measured: list[Prompt] = field(default_factory=list)

    def tokenize(self, tok: Any) -> None:
        """The prompts' ids (once: every configuration runs the same model and tokenizer)."""
        if self.measured:
            return
        for r in self.requests:
            self.warm.append(build_prompt(tok, self.docs, r.docs_warm, r.question))
            self.measured.append(build_prompt(tok, self.docs, r.docs_measured, r.question))


def make_docs(num: int, seed: int) -> tuple[list[str], list[dict[str, Any]]]:
    """`num` documents about companies with distinct names (the rag workload's generator)."""
    docs, companies, names = [], [], set()
    group = 0
    while len(docs) < num:
        company = company_facts(seed, group)
        group += 1
        if company["name"] in names:
            continue
        names.add(company["name"])
        companies.append(company)
        docs.append(company_passages(company))
    return docs, companies


def make_requests(num: int, companies: list[dict[str, Any]], seed: int) -> list[Request]:
    """Each request: 4-6 documents without replacement, a question about one, two orders."""
    requests = []
    for i in range(num):
        rng = rng_for(seed, "segments-request", i)
        chosen = rng.sample(range(len(companies)), rng.randint(4, min(6, len(companies))))
        template, _ = rng.choice(QUESTIONS)
        question = template.format(**companies[rng.choice(chosen)])
        measured = list(chosen)
        while measured == chosen and len(chosen) > 1:
            rng.shuffle(measured)
        requests.append(Request(tuple(chosen), tuple(measured), question))
    return requests


def build_prompt(tok: Any, docs: list[str], order: tuple[int, ...], question: str) -> Prompt:
    """Token ids of header + documents + question, each piece tokenized alone."""
    pieces = [tok.encode(HEADER)]
    pieces += [tok.hf.encode(docs[i], add_special_tokens=False) for i in order]
    pieces.append(tok.hf.encode(f"Question: {question}\nAnswer:", add_special_tokens=False))
    ids: list[int] = []
    spans = []
    for i, piece in enumerate(pieces):
        if 0 < i < len(pieces) - 1:
            spans.append([len(ids), len(ids) + len(piece)])
        ids += piece
    return Prompt(ids, spans)
