"""The in-process backend: programs run on an `sglite.Engine` without HTTP.

`sgl.set_default_backend(sgl.Engine())` wraps the engine in an `EngineBackend` automatically
(`as_backend`); `EngineBackend()` with no engine starts one and shuts it down with itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from sglite.lang.backend.base import NativeBackend
from sglite.lang.chat_template import ChatTemplate, from_tokenizer, get_chat_template


class EngineBackend(NativeBackend):
    """Runs programs on an in-process `sglite.Engine`.

    The chat template is the engine's model's own (from its tokenizer) unless
    `chat_template_name` names one. Invariant: requests are exactly the native protocol's
    payloads, delivered through `Engine.generate`, so decisions match `RuntimeEndpoint`'s.
    """

    def __init__(
        self,
        engine: Any = None,
        chat_template_name: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        if engine is None:
            from sglite.runtime.engine import Engine

            engine = Engine(**engine_kwargs)
            self._owns_engine = True
        elif engine_kwargs:
            raise TypeError("pass either an engine or engine options, not both")
        else:
            self._owns_engine = False
        self.engine = engine
        self.model_path = _model_path(engine)
        if chat_template_name:
            self.chat_template: ChatTemplate = get_chat_template(chat_template_name)
        else:
            self.chat_template = from_tokenizer(engine.tokenizer, self.model_path)

    def get_model_name(self) -> str:
        return self.model_path

    # ------------------------------------------------------------------ transport
    def _request(self, payload: dict[str, Any]) -> Any:
        return self.engine.generate(**_generate_kwargs(payload))

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.engine.generate(**_generate_kwargs(payload), stream=True)

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        """Shut the engine down if this backend started it."""
        if self._owns_engine:
            self.engine.shutdown()


def _generate_kwargs(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt": payload.get("text"),
        "input_ids": payload.get("input_ids"),
        "sampling_params": payload.get("sampling_params"),
        "return_logprob": payload.get("return_logprob", False),
        "logprob_start_len": payload.get("logprob_start_len"),
        "top_logprobs_num": payload.get("top_logprobs_num"),
        "return_text_in_logprobs": payload.get("return_text_in_logprobs", False),
        "image_data": payload.get("image_data"),
        "segments": payload.get("segments"),
    }


def _model_path(engine: Any) -> str:
    path = getattr(getattr(engine, "server_args", None), "model_path", None)
    if path:
        return str(path)
    try:
        from sglite.runtime.model.loader import default_model_path

        return default_model_path()
    except Exception:
        return "default"


_wrap_lock = threading.Lock()


def as_backend(obj: Any) -> Any:
    """`obj` as a backend: an `sglite.Engine` becomes its `EngineBackend` (one per engine, kept on
    the engine), an object with an `endpoint` (a `Runtime`) becomes that endpoint, anything else
    is returned as is."""
    from sglite.runtime.engine import Engine

    if isinstance(obj, Engine):
        with _wrap_lock:
            backend = getattr(obj, "_sglite_lang_backend", None)
            if backend is None:
                backend = EngineBackend(obj)
                obj._sglite_lang_backend = backend  # the engine owns its backend's lifetime
            return backend
    endpoint = getattr(obj, "endpoint", None)
    if endpoint is not None:
        return endpoint
    return obj
