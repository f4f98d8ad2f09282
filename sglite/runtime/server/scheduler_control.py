"""Scheduler control requests made by HTTP routes (server info, cache flush, the web UI's cache
tree), with the scheduler dying or hanging during one answered as 503."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from sglite.http.errors import APIError
from sglite.runtime.server.state import ServerState


async def control_or_503(state: ServerState, kind: str, **args: Any) -> Any:
    """A scheduler control request; 503 when the scheduler dies (or hangs) while it runs.

    `check_alive` before the call cannot see a death during it, which would otherwise surface
    as a RuntimeError (a 500, or a 400 from /flush_cache).
    """
    try:
        return await state.control(kind, **args)
    except (TimeoutError, FutureTimeoutError):
        raise APIError(503, f"the model did not answer ({kind}) in time") from None
    except Exception:
        state.check_alive()  # raises the 503 naming why, if the scheduler is gone
        raise
