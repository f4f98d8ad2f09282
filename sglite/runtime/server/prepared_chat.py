"""A chat request prepared for the scheduler, shared by /v1/chat/completions and /v1/responses:
the request checked (400 naming the field), its prompt rendered (`chat_prompt.py`), its output
constraint and token budget chosen, and its scheduler requests admitted; with what reading the
answers needs (tool plan, reasoning format, logprob settings).

Invariants: enforced tool calls (a grammar from the tool plan) exclude any other output
constraint; a request without `max_tokens` gets the room left after its prompt, capped by the
server's limits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sglite.http.errors import APIError
from sglite.runtime.reasoning import ReasoningFormat, get_reasoning_format
from sglite.runtime.server.chat_prompt import render_messages
from sglite.runtime.server.chat_tools import ToolPlan, parse_answer, plan_tools, special_markers
from sglite.runtime.server.openai_common import (
    OutputConstraint,
    check_common,
    output_constraint,
    prepare,
    sampling_params,
)
from sglite.runtime.server.openai_protocol import ChatCompletionRequest
from sglite.runtime.server.serving import bootstrap_of
from sglite.runtime.server.state import ServerState
from sglite.runtime.server_args import ServerArgs
from sglite.runtime.tokenizing.request import GenerateRequest
from sglite.runtime.tool_calls.types import ToolCall


@dataclass
class ChatAnswer:
    """A finished answer split into reasoning, text and tool calls."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]


@dataclass
class PreparedChat:
    """A chat request checked, rendered and turned into scheduler requests, with what reading
    its answers needs (shared by /v1/chat/completions and /v1/responses)."""

    reqs: list[GenerateRequest]
    plan: ToolPlan
    reasoning: ReasoningFormat | None
    n: int
    base_id: str
    want_logprobs: bool
    num_top: int
    prompt_ids: list[int]

    def answer(self, text: str) -> ChatAnswer:
        """The reasoning, text and calls of one finished output."""
        reasoning, rest = (None, text) if self.reasoning is None else self.reasoning.split(text)
        parsed = parse_answer(self.plan, rest)
        return ChatAnswer(reasoning, parsed.content, parsed.calls)


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> PreparedChat:
    """Check `body` (400 naming the field), render it and admit its scheduler requests."""
    check_common(state, body)
    constraint = output_constraint(body)
    plan = plan_tools(state, body)
    if plan.grammar is not None:
        if constraint is not None:
            raise APIError(
                400,
                f"{constraint.field.split('.')[0]}: cannot be combined with enforced tool calls "
                "(tool_choice required, a named function, or strict tools)",
                param=constraint.field.split(".")[0],
            )
        constraint = OutputConstraint("ebnf", plan.grammar, "tools")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
    ids, images, segments = render_messages(state, body, plan)
    tm = state.tokenizer_manager
    items = None
    if images:
        try:
            prepared = await tm.prepare_images(images, "messages")
            ids, items = tm.expand_images(ids, prepared, "messages")
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_budget(state.args, len(ids), min(tm.context_len, tm.max_total_tokens))
    base_id = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    params = sampling_params(body, max_tokens, constraint)
    if special_markers(state, plan):
        params["skip_special_tokens"] = False
    want_logprobs = bool(body.logprobs)
    num_top = body.top_logprobs or 0
    reqs = prepare(
        state,
        "messages",
        constraint,
        text=None,
        input_ids=ids,
        sampling_params=params,
        return_logprob=want_logprobs,
        logprob_start_len=-1,
        top_logprobs_num=num_top,
        return_text_in_logprobs=True,
        rid=base_id,
        image_items=items,
        bootstrap=bootstrap_of(state, body),
        segments=[list(span) for span in segments] or None,
    )
    reasoning = _reasoning_format(state, body)
    return PreparedChat(reqs, plan, reasoning, body.n or 1, base_id, want_logprobs, num_top, ids)


def default_budget(args: ServerArgs, prompt_tokens: int, room: int) -> int:
    """New tokens for a chat without max_tokens: the rest of the context (or of the KV pool,
    `room`), at most `--default-max-tokens` (0: no cap) and `--max-new-tokens-limit`."""
    budget = max(0, room - prompt_tokens)
    for cap in (args.default_max_tokens or None, args.max_new_tokens_limit):
        if cap is not None:
            budget = min(budget, cap)
    return budget


def _reasoning_format(state: ServerState, body: ChatCompletionRequest) -> ReasoningFormat | None:
    """The server's reasoning format, unless the request keeps reasoning in the content."""
    name = state.args.reasoning_parser
    if name is None or body.separate_reasoning is False:
        return None
    return get_reasoning_format(name)
