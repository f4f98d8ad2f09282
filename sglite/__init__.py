"""sglite: SGLang's language for LM programs and a fast CPU-first runtime with RadixAttention.

`import sglite as sgl` gives SGLang's frontend API (`sgl.function`, `sgl.gen`, `sgl.select`,
roles, `sgl.RuntimeEndpoint`, `sgl.OpenAI`, `sgl.set_default_backend`, ...) next to the
runtime's `Engine`.
"""

from sglite.lang import (
    EngineBackend,
    OpenAI,
    Runtime,
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    call_tool,
    flush_cache,
    function,
    function_tool,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    global_config,
    greedy_token_selection,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    tools_prompt,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from sglite.runtime.engine import Engine

__all__ = [
    "Engine", "EngineBackend", "OpenAI", "Runtime", "RuntimeEndpoint", "assistant",
    "assistant_begin", "assistant_end", "call_tool", "flush_cache", "function", "function_tool",
    "gen", "gen_int", "gen_string", "get_server_info", "global_config", "greedy_token_selection",
    "image", "select", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "tools_prompt", "unconditional_likelihood_normalized", "user",
    "user_begin", "user_end", "video",
]  # fmt: skip
__version__ = "0.1.0"
