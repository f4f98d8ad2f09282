"""The HTTP server: SGLang's native API and the OpenAI-compatible API over one runtime.

The names below are imported on first use, so importing one of this package's modules does not
import the whole runtime. What the server shares with the router lives in `sglite.http`.
"""

from typing import Any

__all__ = ["ServerState", "build_state", "create_app", "launch_server"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from sglite.runtime.server.app import create_app

        return create_app
    if name == "launch_server":
        from sglite.runtime.server.launch import launch_server

        return launch_server
    if name in ("ServerState", "build_state"):
        from sglite.runtime.server import state

        return getattr(state, name)
    raise AttributeError(f"module 'sglite.runtime.server' has no attribute {name!r}")
