"""sglite: SGLang's language for LM programs and a fast CPU-first runtime with RadixAttention.

`import sglite as sgl` gives SGLang's frontend API (`sgl.function`, `sgl.gen`, `sgl.select`,
roles, `sgl.RuntimeEndpoint`, `sgl.OpenAI`, `sgl.set_default_backend`, ...) next to the
runtime's `Engine`. Both load on first use: the language when one of its names is first read,
the runtime (torch and the model code) when `sgl.Engine` is, so a program that talks to a server
starts without the runtime, and the server's processes, which import `sglite.runtime` modules
directly, start without the language.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for readers and type checkers; at run time the names load on first use
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
        segment,
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
    "image", "segment", "select", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "tools_prompt", "unconditional_likelihood_normalized", "user",
    "user_begin", "user_end", "video",
]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sglite.runtime.engine import Engine

        return Engine
    if name in __all__:
        import sglite.lang

        value = getattr(sglite.lang, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'sglite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
