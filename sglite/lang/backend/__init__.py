"""Backends the language runs on: in-process `EngineBackend`, HTTP `RuntimeEndpoint`, `Runtime`,
and `OpenAI` for any OpenAI-compatible API."""

from sglite.lang.backend.base import BaseBackend, NativeBackend
from sglite.lang.backend.engine_backend import EngineBackend
from sglite.lang.backend.openai import OpenAI
from sglite.lang.backend.runtime import Runtime
from sglite.lang.backend.runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "EngineBackend", "NativeBackend", "OpenAI", "Runtime", "RuntimeEndpoint"]
