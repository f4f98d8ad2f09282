"""Backends the language runs on: in-process `EngineBackend`, HTTP `RuntimeEndpoint`, `Runtime`."""

from sglite.lang.backend.base import BaseBackend, NativeBackend
from sglite.lang.backend.engine_backend import EngineBackend
from sglite.lang.backend.runtime import Runtime
from sglite.lang.backend.runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "EngineBackend", "NativeBackend", "Runtime", "RuntimeEndpoint"]
