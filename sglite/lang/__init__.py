"""The SGLang language: `@function`, `gen`, `select`, roles, `fork`, `run` / `run_batch`.

Everything public is re-exported from `sglite` itself (`import sglite as sgl`).
"""

from sglite.lang.api import (
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    segment,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from sglite.lang.backend.base import BaseBackend
from sglite.lang.backend.engine_backend import EngineBackend
from sglite.lang.backend.openai import OpenAI
from sglite.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglite.lang.chat_template import ChatTemplate, get_chat_template
from sglite.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from sglite.lang.global_config import global_config
from sglite.lang.program import SglFunction
from sglite.lang.program_state import ProgramState, ProgramStateGroup
from sglite.lang.tools import call_tool, function_tool, tools_prompt

__all__ = [
    "BaseBackend", "ChatTemplate", "EngineBackend", "OpenAI", "ProgramState", "ProgramStateGroup",
    "Runtime", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin", "assistant_end",
    "call_tool", "flush_cache", "function", "function_tool", "gen", "gen_int", "gen_string",
    "get_chat_template",
    "get_server_info", "global_config", "greedy_token_selection", "image", "segment", "select",
    "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "tools_prompt",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]  # fmt: skip
