"""The uvicorn server of `sglite serve`: it drains on the first signal and says when ready
(see `launch.py` for the shutdown order)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from sglite.runtime.server.state import ServerState

# Seconds uvicorn waits, past the drain, for connections to finish before closing them anyway.
CONNECTION_CLOSE_GRACE = 10


class HTTPServer(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests on the first signal and says when ready."""

    def __init__(self, config: uvicorn.Config, state: ServerState, url: str) -> None:
        super().__init__(config)
        self._state = state
        self._url = url
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self._state
        loop = self._loop
        # Signal handlers interrupt the loop thread anywhere; let the loop run the drain/aborts.
        if loop is not None and not self.should_exit:
            state.shutting_down = True
            timeout = state.args.graceful_shutdown_timeout
            loop.call_soon_threadsafe(lambda: self._keep(loop.create_task(state.drain(timeout))))
        elif loop is not None:  # a second signal: do not wait
            loop.call_soon_threadsafe(
                state.tokenizer_manager.abort_all, "the server is shutting down"
            )
        super().handle_exit(sig, frame)

    def _keep(self, task: asyncio.Task) -> None:
        self._drain_task = task  # the loop holds tasks weakly

    def stop(self) -> None:
        """Make the server exit (called on its loop after the scheduler died for good)."""
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._state.watch_scheduler(self.stop)
        await self._state.warmup()  # before listening, so /health means "ready and warm"
        await super().startup(sockets)
        if self.started:
            print(
                f"sglite is ready: {self._url} (model {self._state.model_name}; "
                f"OpenAI API at {self._url}/v1; Ctrl-C to stop)",
                flush=True,
            )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # Stop the scheduler here, before uvicorn re-raises the signal that stopped it.
        await asyncio.to_thread(self._state.shutdown)
