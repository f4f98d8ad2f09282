"""Process-wide settings of the language (SGLang's `global_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    """Settings read by the interpreter at run time.

    `default_backend` is what `sgl.set_default_backend` sets; `enable_precache_with_tracing`
    makes `run_batch` send the traced constant prefix to the cache first (only when it is longer
    than `precache_min_chars`, as SGLang does); `enable_parallel_encoding` lets
    `join("concate_and_append")` notify backends that support it.
    """

    default_backend: Any = None
    enable_precache_with_tracing: bool = True
    precache_min_chars: int = 64
    enable_parallel_encoding: bool = True
    verbosity: int = 0


global_config = GlobalConfig()
