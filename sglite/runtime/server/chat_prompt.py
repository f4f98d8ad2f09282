"""The prompt of a chat completion: its messages rendered through the model's chat template into
token ids, with the images of their `image_url` parts and the token spans of messages marked
`"reuse": true`.

Invariants: images are listed in the order their parts appear; a message with images goes to the
template as content parts only when the template renders image parts itself (probed once per
template), otherwise as text with the model's image token where each image was; the ids start
with at most one BOS.
"""

from __future__ import annotations

from typing import Any

from sglite.http.errors import APIError
from sglite.runtime.server.chat_tools import ToolPlan, prepare_messages
from sglite.runtime.server.openai_protocol import ChatCompletionRequest
from sglite.runtime.server.state import ServerState


def _content_parts(
    state: ServerState, content: list[Any], i: int, images: list[dict[str, str]]
) -> list[dict[str, str]]:
    """A content part list as the chat template's parts (`{"type": "text", "text": ...}` and,
    for each `image_url` part, `{"type": "image"}`, as transformers' processors give templates);
    each image's source is appended to `images` (labelled with where it came from)."""
    builder = state.tokenizer_manager.images
    parts = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
            continue
        where = f"messages.{i}.content.{j}"
        if part.type == "image_url" and builder is not None:
            url = getattr(part, "image_url", None)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{where}: image_url needs a url", param=where)
            images.append({"url": url, "label": where})
            parts.append({"type": "image"})
            continue
        kind = "text and image_url" if builder is not None else "text"
        raise APIError(
            400,
            f"{where}: only {kind} content parts are supported for this model "
            f"(got type {part.type!r})",
            param=f"messages.{i}.content",
            code="not_supported",
        )
    return parts


def _flatten(parts: list[dict[str, str]], image_token: str | None) -> str:
    """Parts as one text, each image part the model's image token (for templates that take a
    string content)."""
    return "".join(p["text"] if p["type"] == "text" else (image_token or "") for p in parts)


_PROBE_TEXT = "sglite-probe-text"
_TEMPLATE_TAKES_PARTS: dict[str, bool] = {}  # chat template -> whether it renders image parts


def _template_takes_parts(state: ServerState, image_token: str) -> bool:
    """Whether the chat template writes a message's image parts itself (`{"type": "image"}` in
    a content list, as LLaVA's templates do, e.g. as `<image>\\n`): tried once per template on
    one user message of an image and a text."""
    template = state.tokenizer.chat_template
    if template is None:
        return False
    if template not in _TEMPLATE_TAKES_PARTS:
        probe = [{"type": "image"}, {"type": "text", "text": _PROBE_TEXT}]
        try:
            text = state.tokenizer.apply_chat_template(
                [{"role": "user", "content": probe}], add_generation_prompt=True
            )
            takes = text.count(image_token) == 1 and _PROBE_TEXT in text and "'type'" not in text
        except Exception:  # a template that cannot render parts takes text
            takes = False
        _TEMPLATE_TAKES_PARTS[template] = takes
    return _TEMPLATE_TAKES_PARTS[template]


def render_messages(
    state: ServerState, body: ChatCompletionRequest, plan: ToolPlan
) -> tuple[list[int], list[dict[str, str]], list[tuple[int, int]]]:
    """The prompt's token ids, its images (`image_url` parts, in order) and the token spans of
    the messages marked `"reuse": true` (their content is a reusable segment)."""
    messages = []
    images: list[dict[str, str]] = []
    builder = state.tokenizer_manager.images
    image_token = builder.image_token if builder is not None else None
    for i, msg in enumerate(body.messages):
        content: Any = msg.content
        if isinstance(content, list):
            parts = _content_parts(state, content, i, images)
            # A message with images goes to a template that renders image parts as its parts
            # (the template places the image token and what surrounds it, as transformers'
            # processor does); otherwise as text with the image token where each image was.
            with_image = any(p["type"] == "image" for p in parts)
            if with_image and _template_takes_parts(state, image_token):
                content = parts
            else:
                content = _flatten(parts, image_token)
        entry: dict[str, Any] = {"role": msg.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(msg, key)
            if value is not None:
                entry[key] = value
        messages.append(entry)
    continue_final = bool(body.continue_final_message)
    if continue_final and messages[-1]["role"] != "assistant":
        raise APIError(
            400,
            "continue_final_message: the last message must be from the assistant",
            param="continue_final_message",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    if continue_final:
        kwargs["continue_final_message"] = True
    messages = prepare_messages(plan, messages)
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=not continue_final, tools=plan.tools, **kwargs
        )
    except Exception as exc:  # template errors (e.g. roles must alternate) are the client's
        raise APIError(
            400, f"messages: the chat template rejected them: {exc}", "messages"
        ) from None
    reused = _reused_spans(body, text)
    if reused:
        ids, spans = state.tokenizer_manager.encode_with_segments(text, reused)
    else:
        ids, spans = state.tokenizer.encode(text), []
    bos = state.tokenizer.bos_token_id
    # Templates that write the BOS text themselves get a second BOS from the tokenizer.
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids, spans = ids[1:], [(a - 1, b - 1) for a, b in spans]
    return ids, images, spans


def _reused_spans(body: ChatCompletionRequest, text: str) -> list[tuple[int, int]]:
    """Character spans in the rendered `text` of the contents of messages marked `"reuse":
    true` (found in order; a content the template changed cannot be marked: 400)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(body.messages):
        if (msg.model_extra or {}).get("reuse") is not True:
            continue
        content = msg.content
        start = text.find(content, cursor) if isinstance(content, str) and content else -1
        if start < 0:
            raise APIError(
                400,
                f"messages[{i}].reuse: only a message with text content the chat template "
                "keeps as it is can be reused",
                param=f"messages[{i}].reuse",
            )
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans
