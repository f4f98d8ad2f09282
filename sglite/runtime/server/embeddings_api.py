"""Embeddings and reranking with the loaded model: `POST /v1/embeddings` (OpenAI), `POST /encode`
(SGLang's native route) and `POST /v1/rerank` (Jina / Cohere shape, as vLLM serves it).

Embeddings are the model's final hidden states pooled over the prompt (`--pooling`: the last
token's, or the mean) and L2-normalized, computed by the scheduler in its prefill batches
(`scheduler/pooling.py`), so they share the radix cache with generation. Reranking scores a
document the way decoder rerankers (Qwen3-Reranker) are trained: the model is asked, through its
chat template, whether the document answers the query, and the score is P(yes) / (P(yes) +
P(no)) of its next token, read as the prompt logprobs of the two answers (the question is
computed once: the second answer reuses it from the cache).
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from sglite.http.errors import APIError
from sglite.http.streaming import run_until_disconnect
from sglite.runtime.server.errors import bad_request, error_responses
from sglite.runtime.server.serving import check_request_ids, get_state, raise_if_aborted
from sglite.runtime.server.state import ServerState
from sglite.runtime.server.types import Bool, Int, Text
from sglite.runtime.tokenizing.request import GenerateRequest

router = APIRouter()
_ERRORS = error_responses(400, 401, 413, 503, 504)

RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_JUDGE = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    input: Text | list[Text] | list[Int] | list[list[Int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, description="only the model's own size is supported")
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EncodeRequest(BaseModel):
    """POST /encode (SGLang's native embedding route)."""

    text: Text | list[Text] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    rid: str | list[str] | None = None


class RerankRequest(BaseModel):
    """POST /v1/rerank."""

    query: Text = Field(min_length=1)
    documents: list[Text] = Field(min_length=1)
    model: str | None = None
    top_n: Int | None = Field(None, ge=1)
    return_documents: Bool = True
    instruction: Text | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, str] | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


async def _run(request: Request, state: ServerState, reqs: list[GenerateRequest]) -> list[dict]:
    state.admit(len(reqs))
    results = await run_until_disconnect(request, state.tokenizer_manager.generate(reqs))
    for result in results:
        raise_if_aborted(state, result)
    return results


def _embedding_requests(
    state: ServerState, text: Any, input_ids: Any, field: str, rid: Any = None
) -> tuple[list[GenerateRequest], bool]:
    try:
        reqs, is_batch = state.tokenizer_manager.embedding_requests(text, input_ids, rid)
    except ValueError as exc:
        err = bad_request(exc)
        err.param = field  # the route's own name for the prompt
        if not err.message.startswith(field):
            err.message = f"{field}: {err.message}"
        raise err from None
    check_request_ids(state.tokenizer_manager, reqs)
    return reqs, is_batch


def _pack(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """Embed one input or several (texts or token ids)."""
    state = get_state(request)
    state.check_model(body.model)
    if body.dimensions is not None and body.dimensions != state.hidden_size:
        raise APIError(
            400,
            f"dimensions: this model's embeddings have {state.hidden_size}",
            param="dimensions",
        )
    value = body.input
    texts = value if isinstance(value, str) or (value and isinstance(value[0], str)) else None
    ids = None if texts is not None else value
    if not value:
        raise APIError(400, "input: must not be empty", param="input")
    reqs, _ = _embedding_requests(state, texts, ids, "input")
    results = await _run(request, state, reqs)
    tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    data = [
        EmbeddingData(index=i, embedding=_pack(r["embedding"], body.encoding_format))
        for i, r in enumerate(results)
    ]
    return EmbeddingResponse(
        data=data,
        model=body.model or state.model_name,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


@router.post("/encode", responses=_ERRORS)
async def encode(body: EncodeRequest, request: Request) -> Any:
    """SGLang's native embedding route: `{"embedding", "meta_info"}`, or a list for a batch."""
    state = get_state(request)
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "text: give exactly one of text and input_ids", param="text")
    field = "text" if body.text is not None else "input_ids"
    reqs, is_batch = _embedding_requests(state, body.text, body.input_ids, field, body.rid)
    results = await _run(request, state, reqs)
    return results if is_batch else results[0]


def _rerank_prompt(state: ServerState, query: str, document: str, instruction: str) -> list[int]:
    user = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    messages = [{"role": "system", "content": _JUDGE}, {"role": "user", "content": user}]
    tok = state.tokenizer
    if tok.chat_template is None:
        text = f"{_JUDGE}\n\n{user}\n\nAnswer: "
    else:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text)


def _answer_ids(state: ServerState) -> tuple[int, int]:
    """The token ids of "yes" and "no" as the answer's first token."""
    tok = state.tokenizer
    ids = []
    for word in ("yes", "no"):
        token = tok.token_to_id(word)
        if token is None:
            token = tok.encode(word, add_special_tokens=False)[-1]
        ids.append(int(token))
    return ids[0], ids[1]


@router.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
    """Score each document's relevance to the query (in [0, 1]), best first."""
    state = get_state(request)
    state.check_model(body.model)
    yes, no = _answer_ids(state)
    instruction = body.instruction or RERANK_INSTRUCTION
    prompts = [_rerank_prompt(state, body.query, d, instruction) for d in body.documents]
    rid = uuid.uuid4().hex
    try:
        reqs, _ = state.tokenizer_manager.normalize(
            input_ids=[p + [answer] for p in prompts for answer in (yes, no)],
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=[len(p) - 1 for p in prompts for _ in (yes, no)],
            rid=[f"rerank-{rid}-{i}" for i in range(2 * len(prompts))],
        )
    except ValueError as exc:
        err = bad_request(exc)
        err.param = "documents"
        raise err from None
    results = await _run(request, state, reqs)
    scored = []
    for i, doc in enumerate(body.documents):
        ly = results[2 * i]["meta_info"]["input_token_logprobs"][-1][0]
        ln = results[2 * i + 1]["meta_info"]["input_token_logprobs"][-1][0]
        score = 1.0 / (1.0 + math.exp(ln - ly))
        document = {"text": doc} if body.return_documents else None
        scored.append(RerankResult(index=i, relevance_score=score, document=document))
    scored.sort(key=lambda r: -r.relevance_score)
    tokens = sum(len(p) + 1 for p in prompts)
    return RerankResponse(
        id=f"rerank-{rid}",
        model=body.model or state.model_name,
        results=scored[: body.top_n] if body.top_n else scored,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
