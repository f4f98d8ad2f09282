"""The HTTP server: SGLang's native API and the OpenAI-compatible API over one runtime."""

from sglite.runtime.server.app import create_app
from sglite.runtime.server.launch import launch_server
from sglite.runtime.server.state import ServerState, build_state

__all__ = ["ServerState", "build_state", "create_app", "launch_server"]
