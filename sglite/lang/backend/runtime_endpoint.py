"""`sgl.RuntimeEndpoint(url)`: run programs on a server speaking SGLang's native protocol.

Works with `python -m sglite.launch_server` and with SGLang's own server. Uses only the standard
library for HTTP, so the language needs no HTTP client package.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from sglite.lang.backend.base import NativeBackend
from sglite.lang.chat_template import (
    ChatTemplate,
    from_tokenizer,
    get_chat_template,
    get_chat_template_by_model_path,
)

logger = logging.getLogger(__name__)


class RuntimeEndpoint(NativeBackend):
    """A backend at `base_url` (e.g. `http://127.0.0.1:30000`).

    The chat template: `chat_template_name` if given; else, when the server's `model_path`
    (from `/get_model_info`) is a local path, the model's own template from its tokenizer; else
    SGLang's named template matched from the path. `api_key` is sent as a Bearer token.
    Raises RuntimeError (with the server's message) when a request fails.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = None,
        chat_template_name: str | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.support_concate_and_append = True
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify  # accepted for SGLang compatibility; TLS uses the system defaults
        self.timeout = timeout
        self.model_info: dict[str, Any] = self._http("GET", "/get_model_info")
        if chat_template_name:
            self.chat_template: ChatTemplate = get_chat_template(chat_template_name)
        else:
            self.chat_template = _template_for(self.model_info)

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> None:
        self._http("POST", "/flush_cache", raw=True)

    def get_server_info(self) -> dict[str, Any]:
        return self._http("GET", "/get_server_info")

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        self._http(
            "POST", "/concate_and_append_request", {"src_rids": src_rids, "dst_rid": dst_rid}
        )

    # ------------------------------------------------------------------ transport
    def _request(self, payload: dict[str, Any]) -> Any:
        return self._http("POST", "/generate", payload)

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        response = self._open("POST", "/generate", payload)
        with response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise RuntimeError(f"{self.base_url}/generate stream failed: {message}")
                yield event

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _open(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers=self._headers()
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"{method} {self.base_url}{path} failed with HTTP {exc.code}: {_message(exc)}"
            ) from None
        except urllib.error.URLError as exc:
            raise RuntimeError(f"cannot reach {self.base_url}{path}: {exc.reason}") from None

    def _http(self, method: str, path: str, body: Any = None, raw: bool = False) -> Any:
        with self._open(method, path, body) as response:
            payload = response.read()
        return payload.decode("utf-8") if raw else json.loads(payload)


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        body = exc.read().decode("utf-8", "replace")
    except Exception:
        return str(exc)
    try:
        obj = json.loads(body)
    except ValueError:
        return body.strip() or str(exc)
    error = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _template_for(model_info: dict[str, Any]) -> ChatTemplate:
    model_path = model_info.get("model_path") or ""
    tokenizer_path = model_info.get("tokenizer_path") or model_path
    if tokenizer_path and os.path.exists(tokenizer_path):
        try:
            from sglite.runtime.model.loader import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_path, model_path or None)
            return from_tokenizer(tokenizer, model_path)
        except Exception as exc:  # an unreadable tokenizer is not fatal: use a named template
            logger.info("could not read the tokenizer at %s (%s)", tokenizer_path, exc)
    return get_chat_template_by_model_path(model_path)
