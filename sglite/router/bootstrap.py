"""PD disaggregation's handshake data: the workers' roles, the prefill workers' bootstrap ports,
each request's bootstrap room and the two copies of its body.

A prefill server runs a bootstrap server at (the host of its URL, its
`disaggregation_bootstrap_port`); the decode server given the same `bootstrap_room` as the
prefill server meets it there and receives that request's KV cache. Both ports and roles are
read from the workers' `GET /get_server_info`.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import httpx

from sglite.router.workers import Worker

logger = logging.getLogger("sglite.router")

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)
# Fields of an OpenAI request that only make sense for a streamed answer: the prefill copy is
# never streamed, and a server may refuse `stream_options` without `stream: true`.
STREAM_ONLY_FIELDS = ("stream_options",)
ROOM_BITS = 63  # rooms are non-negative signed 64-bit ints on the servers


class RoleError(Exception):
    """A worker is not (or cannot be shown to be) a PD server of the expected role."""


class _Unauthorized(RoleError):
    """The worker wants an API key for /get_server_info."""


@dataclass(frozen=True)
class Bootstrap:
    """Where one request's decode server fetches its KV cache from, and under which room."""

    host: str
    port: int
    room: int

    def fields(self) -> dict[str, Any]:
        """The top-level fields added to both copies of the request."""
        return {
            "bootstrap_host": self.host,
            "bootstrap_port": self.port,
            "bootstrap_room": self.room,
        }


def new_room() -> int:
    """A random room: unique enough among the requests in flight on one prefill server."""
    return secrets.randbits(ROOM_BITS)


def prefill_body(body: dict[str, Any], bootstrap: Bootstrap) -> bytes:
    """The prefill copy: never streamed (its answer is only waited for, then discarded)."""
    copy = {k: v for k, v in body.items() if k not in STREAM_ONLY_FIELDS}
    return _dump({**copy, **bootstrap.fields(), "stream": False})


def decode_body(body: dict[str, Any], bootstrap: Bootstrap) -> bytes:
    """The decode copy: the client's request (streamed or not) plus the bootstrap fields."""
    return _dump({**body, **bootstrap.fields()})


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class RoleCheck:
    """Checks that the workers of one PD group have the group's role, and remembers each prefill
    worker's bootstrap port.

    Invariant: `ports` holds a port only for a worker whose /get_server_info gave it since the
    worker last went down (a restarted prefill server may listen on another bootstrap port).
    """

    def __init__(self, client: httpx.AsyncClient, role: str, timeout: float) -> None:
        self._client = client
        self.role = role
        self._timeout = timeout
        self.ports: dict[str, int] = {}

    async def admit(self, worker: Worker) -> bool:
        """True if `worker` may get traffic: its info shows the role (its bootstrap port is
        then remembered), or its info needs an API key the router lacks (checked at first use,
        with the client's key). Else False, with the reason in `worker.last_error`."""
        try:
            await self.refresh(worker, {})
        except _Unauthorized:
            logger.warning(
                "%s: /get_server_info needs an API key; role checked at first use", worker.url
            )
            return True
        except RoleError as exc:
            worker.last_error = str(exc)
            logger.warning("%s", exc)
            return False
        return True

    async def bootstrap_port(self, worker: Worker, headers: dict[str, str]) -> int:
        """The prefill worker's bootstrap port, read once (with the client's `headers`, which
        may carry the API key); RoleError if it cannot be had."""
        port = self.ports.get(worker.url)
        if port is None:
            try:
                port = await self.refresh(worker, headers)
            except _Unauthorized as exc:
                raise RoleError(str(exc)) from None
        return port

    def forget(self, url: str) -> None:
        """`url` went down or was removed: read its port again when it is back."""
        self.ports.pop(url, None)

    async def refresh(self, worker: Worker, headers: dict[str, str]) -> int:
        """Read `worker`'s info, check its role and remember its bootstrap port (0 for a decode
        worker); RoleError (or its subclass _Unauthorized) if it does not qualify."""
        info = await self._server_info(worker, headers)
        mode = info.get("disaggregation_mode")
        if mode != self.role:
            raise RoleError(
                f"{worker.url} is not a {self.role} server: its /get_server_info has "
                f"disaggregation_mode {mode!r}"
            )
        if self.role != PREFILL:
            return 0
        port = info.get("disaggregation_bootstrap_port")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise RoleError(
                f"{worker.url}: its /get_server_info has no valid disaggregation_bootstrap_port "
                f"(got {port!r})"
            )
        self.ports[worker.url] = port
        return port

    async def _server_info(self, worker: Worker, headers: dict[str, str]) -> dict[str, Any]:
        try:
            answer = await self._client.get(
                worker.url + "/get_server_info", headers=headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise RoleError(f"{worker.url}/get_server_info failed: {type(exc).__name__}") from None
        if answer.status_code in (401, 403):
            raise _Unauthorized(f"{worker.url}/get_server_info answered {answer.status_code}")
        if answer.status_code != 200:
            raise RoleError(f"{worker.url}/get_server_info answered {answer.status_code}")
        try:
            info = answer.json()
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise RoleError(f"{worker.url}/get_server_info did not answer a JSON object")
        return info


def bootstrap_host(worker: Worker) -> str:
    """The host the decode server reaches the prefill worker's bootstrap server at."""
    return httpx.URL(worker.url).host
