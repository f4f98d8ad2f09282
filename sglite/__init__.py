"""sglite: SGLang's language for LM programs and a fast CPU-first runtime with RadixAttention."""

from sglite.runtime.engine import Engine

__all__ = ["Engine"]
__version__ = "0.1.0"
