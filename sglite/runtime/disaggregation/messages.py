"""The messages of a KV hand-off between a prefill and a decode scheduler.

They travel as ZeroMQ multipart messages: a pickled header (one of the classes below), then the
header's payload frames, if its transport sends any. A `room` names one scheduler request on
both servers: the router gives both copies of a client request the same `bootstrap_room`, and
each server suffixes it with the request's index after batch and `n` expansion (the same body
expands the same way on both).

The exchange for one room:
    decode -> prefill: KVPull (I hold slots for your pages from token `skip` on; send them)
    prefill -> decode: KVPages* (as prefill chunks finish), then KVDone (first token) | KVFailed
    decode -> prefill: KVCancel (the request ended here; drop its pages)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's prefill happens and which room pairs it with its decode."""

    host: str
    port: int
    room: str

    def for_index(self, index: int) -> Bootstrap:
        """The room of the `index`-th scheduler request made from one client request."""
        return Bootstrap(self.host, self.port, f"{self.room}.{index}")


@dataclass
class KVPull:
    """Decode -> prefill: slots are allocated for the prompt's tokens from `skip` on (the ones
    before are in the decode server's own radix cache); `transport` names how to send them."""

    room: str
    skip: int
    num_tokens: int  # the prompt length the decode server tokenized (checked on the other side)
    transport: str


@dataclass
class KVCancel:
    """Decode -> prefill: the request ended on the decode side; free its pages."""

    room: str


@dataclass
class KVPages:
    """Prefill -> decode: K/V of prompt tokens [start, start + count), all layers.

    `meta` is the transport's description of the payload; `checksum` is the CRC-32 of the
    payload bytes (layout: `pages.py`)."""

    room: str
    start: int
    count: int
    transport: str
    meta: dict[str, Any]
    checksum: int


@dataclass
class KVDone:
    """Prefill -> decode: every page was sent; the first output token and what the decode
    server needs to answer as if it had run the prefill itself."""

    room: str
    num_tokens: int
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)


@dataclass
class KVFailed:
    """Prefill -> decode: this room's prefill ended without pages (aborted, timed out)."""

    room: str
    message: str
