"""HTTP pieces shared by the server (`sglite.runtime.server`) and the router (`sglite.router`):
OpenAI-shaped errors, server-sent events and disconnects, ASGI middlewares, the listening socket.

Nothing here imports torch or the runtime, so the router stays light.
"""
