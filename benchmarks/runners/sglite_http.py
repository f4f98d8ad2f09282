"""sglite over HTTP: `sglite serve` on a free loopback port, programs through `RuntimeEndpoint`.

The same programs and measurement as the Engine system (`sglite_engine.py`); the difference is
the HTTP hop (JSON over loopback per call) and the server process in between.
"""

from __future__ import annotations

from typing import Any

from benchmarks.runners.common import default_threads
from benchmarks.runners.sglite_engine import NativeSystem


class HTTPSystem(NativeSystem):
    """`sglite serve` on a free loopback port (`sgl.Runtime`), driven by `sgl.RuntimeEndpoint`."""

    name = "sglite-http"
    description = "sglite HTTP server (sglite serve + RuntimeEndpoint)"

    def __init__(self, threads: int | None = None, **server_kwargs: Any) -> None:
        super().__init__()
        self.server_kwargs = {"num_threads": threads or default_threads(), **server_kwargs}
        self.runtime: Any = None

    def start(self) -> None:
        import sglite

        # sgl.Runtime runs `python -m sglite.launch_server` (what `sglite serve` runs) on the
        # first free port from 31000 on, and waits for /health.
        self.runtime = sglite.Runtime(port=31000, **self.server_kwargs)
        self.backend = self.runtime.endpoint

    def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.shutdown()
            self.runtime = self.backend = None
