"""The tool-call formats by name (`--tool-call-parser`), and which one a chat template uses."""

from __future__ import annotations

from sglite.runtime.tool_calls.base import ToolCallFormat
from sglite.runtime.tool_calls.hermes import HermesFormat
from sglite.runtime.tool_calls.llama3 import Llama3JsonFormat
from sglite.runtime.tool_calls.mistral import MistralFormat
from sglite.runtime.tool_calls.pythonic import PythonicFormat

# Detection order: the most specific markers first.
FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (HermesFormat(), MistralFormat(), Llama3JsonFormat(), PythonicFormat())
}
# SGLang's and vLLM's names for the same formats.
ALIASES = {"qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes", "llama": "llama3"}


def get_format(name: str) -> ToolCallFormat:
    """The format called `name`; ValueError listing the choices otherwise."""
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        choices = ", ".join([*FORMATS, *ALIASES])
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {choices}")
    return FORMATS[key]


def detect_format(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template's tool rendering asks for, None if it renders no tools."""
    if not chat_template:
        return None
    return next((f for f in FORMATS.values() if f.detect(chat_template)), None)
