"""The bodies of the OpenAI Responses API (`responses_api.py`): the request sglite reads, the
response object and the streamed events (as the OpenAPI schema documents them).

A response's `output` is a list of items: `reasoning` (the model's thinking, with
`--reasoning-parser`), a `message` whose content is one `output_text`, and `function_call`s
(`responses_output.py` builds them). Unknown fields are accepted and kept (`extra="allow"`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sglite.runtime.server.types import Bool, Float, Int, Text


class ResponsesRequest(BaseModel):
    """POST /v1/responses (the fields sglite acts on; others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    input: Text | list[dict[str, Any]]
    model: str | None = None
    instructions: Text | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Int | None = None
    stream: Bool | None = False
    store: Bool | None = True
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None


class ResponseObject(BaseModel):
    """A response (the fields clients read; `output` items as the module docstring says)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One streamed event: its `type` (response.created, response.output_text.delta, ...) and
    sequence number, with the fields of that type."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
