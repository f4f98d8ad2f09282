"""How a payload of KV pages travels from the prefill to the decode scheduler.

`KVTransport` is the interface: the sender `pack`s a payload into a description (`meta`,
pickled in the `KVPages` header) and frames sent after the header; the receiver `unpack`s them
back into a buffer. Two are built in:
- `TcpTransport`: the bytes ride in the ZeroMQ message itself (works between hosts);
- `SharedMemoryTransport`: the sender writes the bytes to a file in `/dev/shm` and sends its
  name; the receiver reads and unlinks it (one host: no copy through the socket stack).
An RDMA library (Mooncake, NIXL) fits the same interface: `pack` registers the pages and sends
their remote address, `unpack` reads them into the receiver's buffer.

Invariant: a shared-memory file is unlinked by its reader, or by its writer through
`discard` once its deadline passed (a receiver that died never reads it).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

TRANSPORTS = ("tcp", "shm")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class KVTransport(ABC):
    """Carries one payload (a flat uint8 array) from `pack` to `unpack`."""

    name: str

    @abstractmethod
    def pack(self, payload: np.ndarray) -> tuple[dict[str, Any], list[Any]]:
        """The payload's description and the frames to send after the header."""

    @abstractmethod
    def unpack(self, meta: dict[str, Any], frames: list[Any]) -> Any:
        """The payload's bytes (any buffer) from what `pack` produced."""

    def discard(self, meta: dict[str, Any]) -> None:  # noqa: B027 (most leave nothing behind)
        """Free what `pack` left behind for a payload nobody will read."""


class TcpTransport(KVTransport):
    """The payload is the frame after the header."""

    name = "tcp"

    def pack(self, payload: np.ndarray) -> tuple[dict[str, Any], list[Any]]:
        return {"nbytes": payload.nbytes}, [payload]

    def unpack(self, meta: dict[str, Any], frames: list[Any]) -> Any:
        if len(frames) != 1:
            raise ValueError(f"a tcp KV payload is one frame, got {len(frames)}")
        return frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]


def shm_directory() -> str:
    """Where shared-memory payloads are written: /dev/shm (RAM), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedMemoryTransport(KVTransport):
    """The payload is a file in /dev/shm, read and unlinked by the receiver."""

    name = "shm"

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or shm_directory()

    def pack(self, payload: np.ndarray) -> tuple[dict[str, Any], list[Any]]:
        path = os.path.join(self.directory, f"sglite-kv-{uuid.uuid4().hex}")
        payload.tofile(path)
        return {"path": path, "nbytes": payload.nbytes}, []

    def unpack(self, meta: dict[str, Any], frames: list[Any]) -> Any:
        path = meta["path"]
        if os.path.dirname(path) != self.directory or not os.path.basename(path).startswith(
            "sglite-kv-"
        ):
            raise ValueError(f"a shared-memory KV payload outside {self.directory}: {path}")
        try:
            return np.fromfile(path, dtype=np.uint8)
        finally:
            self.discard(meta)

    def discard(self, meta: dict[str, Any]) -> None:
        try:
            os.unlink(meta["path"])
        except FileNotFoundError:
            pass


def make_transport(name: str) -> KVTransport:
    """The transport called `name` (one of TRANSPORTS)."""
    if name == "tcp":
        return TcpTransport()
    if name == "shm":
        return SharedMemoryTransport()
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}")


def choose_transport(configured: str, prefill_host: str) -> str:
    """The transport a decode server asks for: the configured one, or for `auto` shared memory
    when the prefill server is on this host (a loopback bootstrap address)."""
    if configured != "auto":
        return configured
    return "shm" if prefill_host in LOOPBACK_HOSTS else "tcp"
