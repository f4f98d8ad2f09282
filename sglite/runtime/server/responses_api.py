"""The OpenAI Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`.

A request becomes a chat completion (`responses_input.chat_request`, prepared by
`prepared_chat.prepare_chat`): `instructions` as the system message, `input` (text, or message
and function-call items) after the conversation of `previous_response_id`, tools and
`text.format` translated to their chat forms. Its answer becomes output items
(`responses_output.py`): reasoning, a message with `output_text`, and `function_call`s; streamed,
as events (`responses_stream.py`). Stored responses (`store`, the default) keep their
conversation in a bounded LRU (`--max-stored-responses` entries), so a follow-up names only its
new input and its prompt starts with the cached prefix.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from sglite.http.errors import APIError, ErrorResponse
from sglite.http.streaming import (
    SSE_HEADERS,
    iterate_until_disconnect,
    run_until_disconnect,
    sse_response_content,
    to_json,
)
from sglite.runtime.server.errors import error_responses
from sglite.runtime.server.prepared_chat import ChatAnswer, prepare_chat
from sglite.runtime.server.responses_input import chat_request
from sglite.runtime.server.responses_output import (
    conversation_after,
    new_id,
    output_items,
    response_object,
)
from sglite.runtime.server.responses_protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from sglite.runtime.server.responses_stream import ResponseStream
from sglite.runtime.server.serving import get_state, raise_if_aborted
from sglite.runtime.server.state import ServerState

router = APIRouter(prefix="/v1")


def _reasoning_tokens(state: ServerState, answer: ChatAnswer) -> int:
    return len(state.tokenizer.encode(answer.reasoning)) if answer.reasoning else 0


@router.post(
    "/responses",
    response_model=ResponseObject,
    responses={
        200: {
            "description": "a response, or with `stream` its events (`event:` and `data:` lines)",
            "content": sse_response_content(ResponseStreamEvent, ErrorResponse),
        },
        **error_responses(400, 401, 413, 503, 504),
    },
)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    """Answer `input` (after the conversation of `previous_response_id`) as a response."""
    state = get_state(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        entry = state.responses.get(body.previous_response_id)
        if entry is None:
            raise APIError(
                400,
                f"previous_response_id: no stored response {body.previous_response_id!r}",
                param="previous_response_id",
            )
        history = entry[1]
    chat_body, conversation = chat_request(body, history)
    chat = await prepare_chat(state, chat_body)
    model = body.model or state.model_name
    response_id = new_id("resp")
    if body.stream:
        events = ResponseStream(state, chat, body, model, response_id, conversation).events()
        return StreamingResponse(
            iterate_until_disconnect(request, events),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    (result,) = await run_until_disconnect(request, state.tokenizer_manager.generate(chat.reqs))
    raise_if_aborted(state, result)
    meta = result["meta_info"]
    answer = chat.answer(result["text"])
    status = "incomplete" if (meta["finish_reason"] or {}).get("type") == "length" else "completed"
    response = response_object(
        response_id, body, model, output_items(answer), status, meta,
        _reasoning_tokens(state, answer),
    )  # fmt: skip
    if body.store is not False:
        state.responses.put(response, conversation_after(conversation, answer))
    return Response(to_json(response), media_type="application/json")


@router.get(
    "/responses/{response_id}", response_model=ResponseObject, responses=error_responses(401, 404)
)
async def retrieve_response(response_id: str, request: Request) -> Any:
    """A stored response."""
    entry = get_state(request).responses.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id")
    return Response(to_json(entry[0]), media_type="application/json")


def route_paths() -> set[str]:
    """Paths served by this router (for per-route metrics labels)."""
    return {route.path for route in router.routes}
