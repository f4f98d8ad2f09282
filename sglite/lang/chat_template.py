"""Chat templates for the role primitives (`sgl.system/user/assistant`).

The interpreter renders a role as `prefix + content + suffix` and adds the template's stop
strings to generations inside an assistant turn. A template comes from, in order of preference:

1. the model's own Jinja template (tokenizer / GGUF metadata), reduced to per-role prefixes and
   suffixes by rendering probe conversations (`from_jinja`), so role text is byte-identical to
   what `tokenizer.apply_chat_template` produces;
2. SGLang's named templates, chosen from the model path (`get_chat_template_by_model_path`);
3. the `default` template (`SYSTEM:` / `USER:` / `ASSISTANT:`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

logger = logging.getLogger(__name__)


class ChatTemplateStyle(Enum):
    """PLAIN: every role is `prefix + content + suffix`. LLAMA2: the first system message is
    folded into the first user turn, as Llama-2-chat expects."""

    PLAIN = auto()
    LLAMA2 = auto()


@dataclass
class ChatTemplate:
    """Per-role text around message content.

    Invariant: `role_prefix_and_suffix` maps each role to `(prefix, suffix)`; `stop_str` are the
    strings that end an assistant turn; `default_system_prompt` (None = none) is inserted as a
    system turn when a conversation starts with another role.
    """

    name: str
    default_system_prompt: str | None
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()
    image_token: str = "<image>"
    style: ChatTemplateStyle = ChatTemplateStyle.PLAIN
    source: str = "named"  # "named" or "jinja" (derived from the model's own template)
    doc_start: str = ""  # printed once before the first message (a BOS token the template adds)

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        """The text before and after a `role` message that follows `hist_messages`."""
        prefix, suffix = self.role_prefix_and_suffix.get(role, ("", ""))
        if not hist_messages:
            prefix = self.doc_start + prefix
        if self.style == ChatTemplateStyle.LLAMA2:
            if role == "system" and not hist_messages:
                user_prefix, _ = self.role_prefix_and_suffix.get("user", ("", ""))
                return user_prefix + prefix, suffix
            if (
                role == "user"
                and len(hist_messages) == 1
                and hist_messages[0]["role"] == "system"
                and hist_messages[0]["content"] is not None
            ):
                return "", suffix
        return prefix, suffix

    def get_prompt(self, messages: list[dict]) -> str:
        """The whole conversation as text (a `None` system content means the default prompt)."""
        prompt = ""
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(role, messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt


chat_template_registry: dict[str, ChatTemplate] = {}
matching_function_registry: list[Callable[[str], str | None]] = []


def register_chat_template(template: ChatTemplate) -> None:
    """Add a named template (replacing one of the same name)."""
    chat_template_registry[template.name] = template


def register_chat_template_matching_function(
    func: Callable[[str], str | None],
) -> Callable[[str], str | None]:
    """Register `func(model_path) -> template name | None`; usable as a decorator."""
    matching_function_registry.append(func)
    return func


def get_chat_template(name: str) -> ChatTemplate:
    """The named template; KeyError lists the known names."""
    try:
        return chat_template_registry[name]
    except KeyError:
        known = ", ".join(sorted(chat_template_registry))
        raise KeyError(f"unknown chat template {name!r}; known: {known}") from None


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    """The named template the model path suggests, else `default`."""
    for match in matching_function_registry:
        name = match(model_path or "")
        if name is not None:
            return get_chat_template(name)
    return get_chat_template("default")


# --------------------------------------------------------------------------- named templates
def _same_roles(prefix: Callable[[str], str], suffix: str) -> dict[str, tuple[str, str]]:
    return {role: (prefix(role), suffix) for role in ("system", "user", "assistant")}


_IM = _same_roles(lambda r: f"<|im_start|>{r}\n", "<|im_end|>\n")

register_chat_template(
    ChatTemplate(
        "default",
        None,
        {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
    )
)
register_chat_template(
    ChatTemplate(
        "claude",
        None,
        {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")},
    )
)
register_chat_template(ChatTemplate("chatml", None, dict(_IM), stop_str=("<|im_end|>",)))
register_chat_template(
    ChatTemplate("qwen", "You are a helpful assistant.", dict(_IM), stop_str=("<|im_end|>",))
)
register_chat_template(
    ChatTemplate(
        "vicuna_v1.1",
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions.",
        {"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")},
    )
)
register_chat_template(
    ChatTemplate(
        "llama-2-chat",
        None,
        {
            "system": ("<<SYS>>\n", "\n<</SYS>>\n\n"),
            "user": ("[INST] ", " [/INST]"),
            "assistant": ("", " </s><s>"),
        },
        style=ChatTemplateStyle.LLAMA2,
    )
)
register_chat_template(
    ChatTemplate(
        "mistral",
        None,
        {
            "system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"),
            "user": ("[INST] ", " [/INST]"),
            "assistant": ("", " </s><s>"),
        },
        stop_str=("</s>",),
    )
)
register_chat_template(
    ChatTemplate(
        "llama-3-instruct",
        None,
        _same_roles(lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>"),
        stop_str=("<|eot_id|>",),
    )
)
register_chat_template(
    ChatTemplate(
        "yi-1.5",
        None,
        {
            "system": ("", ""),
            "user": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
            "assistant": ("", "<|im_end|>\n"),
        },
        stop_str=("<|im_end|>",),
    )
)
register_chat_template(
    ChatTemplate(
        "gemma-it",
        None,
        {
            "system": ("", ""),
            "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
            "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
        },
    )
)
register_chat_template(
    ChatTemplate(
        "deepseek-v3",
        None,
        {
            "system": ("", ""),
            "user": ("<｜User｜>", ""),
            "assistant": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
        },
        stop_str=("<｜end▁of▁sentence｜>",),
    )
)
register_chat_template(
    ChatTemplate(
        "granite-3-instruct",
        None,
        _same_roles(lambda r: f"<|start_of_role|>{r}<|end_of_role|>", "<|end_of_text|>"),
        stop_str=("<|end_of_text|>",),
    )
)
register_chat_template(
    ChatTemplate(
        "c4ai-command-r",
        None,
        {
            "system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        },
    )
)


def _matcher(pattern: str, name: str, exclude: str | None = None) -> None:
    def match(model_path: str) -> str | None:
        if re.search(pattern, model_path, re.IGNORECASE) and not (
            exclude and re.search(exclude, model_path, re.IGNORECASE)
        ):
            return name
        return None

    register_chat_template_matching_function(match)


# Most specific first; the same model-path patterns SGLang uses, plus SmolLM (ChatML).
_matcher(r"deepseek-(v3|r1)", "deepseek-v3", exclude=r"base")
_matcher(r"vicuna|llava-v1\.5", "vicuna_v1.1")
_matcher(r"llama-2.*chat|codellama.*instruct", "llama-2-chat")
_matcher(r"pixtral|(mistral|mixtral).*instruct", "mistral")
_matcher(r"llama-3.*instruct", "llama-3-instruct")
_matcher(r"tinyllama|smollm.*instruct|hermes", "chatml")
_matcher(r"qwen.*(chat|instruct)", "qwen", exclude=r"llava")
_matcher(r"yi-1\.5.*chat", "yi-1.5")
_matcher(r"gemma.*it|gemma-3", "gemma-it")
_matcher(r"c4ai-command-r", "c4ai-command-r")
_matcher(r"granite.*instruct", "granite-3-instruct")


# --------------------------------------------------------------------------- model templates
_PROBE = "\u2063SGLITE_PROBE\u2063"  # content no real template rewrites or contains


def _split(text: str) -> tuple[str, str]:
    if text.count(_PROBE) != 1:
        raise ValueError("the template does not render message content verbatim")
    before, after = text.split(_PROBE)
    return before, after


def _after(full: str, base: str) -> str:
    if not full.startswith(base):
        raise ValueError("the template re-renders earlier messages when one is added")
    return full[len(base) :]


def from_jinja(
    render: Callable[[list[dict[str, str]], bool], str], name: str = "model"
) -> ChatTemplate:
    """Reduce a Jinja chat template to per-role prefixes and suffixes.

    `render(messages, add_generation_prompt)` renders a conversation. Each role's text is the
    difference between a conversation with one more message (holding a probe string) and the one
    without it. Text the template prints once at the start of a conversation (a BOS token) is
    `doc_start`; the default system prompt is the system turn the template inserts when the
    conversation opens with a user turn. Raises ValueError when the template is not of the
    `prefix + content + suffix` shape (the caller then falls back to a named template).
    """
    sys_msg = {"role": "system", "content": "S"}
    user_msg = {"role": "user", "content": "U"}

    def probe(role: str) -> dict[str, str]:
        return {"role": role, "content": _PROBE}

    first_system_prefix, system_suffix = _split(render([probe("system")], False))
    base = render([sys_msg], False)
    user_prefix, user_suffix = _split(_after(render([sys_msg, probe("user")], False), base))
    base = render([sys_msg, user_msg], False)
    asst = _after(render([sys_msg, user_msg, probe("assistant")], False), base)
    asst_prefix, asst_suffix = _split(asst)
    generation_prompt = _after(render([sys_msg, user_msg], True), base)
    if generation_prompt and generation_prompt != asst_prefix:
        # Templates whose generation prompt differs from a finished assistant turn's prefix
        # (reasoning templates) cannot be expressed as one prefix per role.
        raise ValueError("the generation prompt differs from the assistant prefix")

    # A system turn after the first message shows what of the first one was document start.
    system_prefix, doc_start = first_system_prefix, ""
    try:
        base = render([sys_msg, user_msg], False)
        later, _ = _split(_after(render([sys_msg, user_msg, probe("system")], False), base))
        if first_system_prefix.endswith(later):
            system_prefix = later
            doc_start = first_system_prefix[: len(first_system_prefix) - len(later)]
    except Exception:  # templates may forbid a late system turn; assume no document start
        pass

    # What the template inserts before a conversation that opens with a user turn.
    opening, _ = _split(render([probe("user")], False))
    if not opening.startswith(doc_start) or not opening.endswith(user_prefix):
        raise ValueError("the first user turn is rendered differently from later ones")
    inserted = opening[len(doc_start) : len(opening) - len(user_prefix)]
    default_system = None
    if inserted:
        if not (inserted.startswith(system_prefix) and inserted.endswith(system_suffix)):
            raise ValueError("the template inserts text that is not a system turn")
        default_system = inserted[len(system_prefix) : len(inserted) - len(system_suffix)]

    stop = asst_suffix.strip()
    return ChatTemplate(
        name=name,
        default_system_prompt=default_system,
        role_prefix_and_suffix={
            "system": (system_prefix, system_suffix),
            "user": (user_prefix, user_suffix),
            "assistant": (asst_prefix, asst_suffix),
        },
        stop_str=(stop,) if stop else (),
        source="jinja",
        doc_start=doc_start,
    )


def from_tokenizer(tokenizer: Any, model_path: str | None = None) -> ChatTemplate:
    """The chat template of a model: its own (via `tokenizer.apply_chat_template`) when the
    tokenizer has one of the supported shape, else the named template for `model_path`.

    `tokenizer` is an `sglite.runtime.tokenizer.Tokenizer` (or anything with `chat_template`,
    `apply_chat_template(messages, add_generation_prompt=...)` and `encode`).
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )

        try:
            template = from_jinja(render, name=f"jinja:{model_path or 'model'}")
        except Exception as exc:  # any template error means "not this shape": fall back
            logger.info("model chat template not usable per role (%s); using a named one", exc)
        else:
            if template.doc_start and _adds_bos(tokenizer):
                template.doc_start = ""  # the tokenizer adds it; printing it too would double it
            return template
    return get_chat_template_by_model_path(model_path or "")


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    try:
        ids = tokenizer.encode("a")
    except Exception:
        return False
    return bos is not None and bool(ids) and ids[0] == bos
