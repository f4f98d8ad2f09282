"""Strict field types shared by the request models.

Pydantic's lax mode would turn `true` into 1 (or 1.0) and `"5"` into 5; SGLang's sampling
parameters reject those as client bugs, so the HTTP layer does too. Integral floats (`128.0`,
which some JSON encoders write) still count as integers. `Text` is a string a tokenizer can encode.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Strict


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral), Strict()]
Bool = Annotated[bool, Strict()]
# Strict floats still take integers (`"temperature": 1`) but not `true` or `"0.5"`.
Float = Annotated[float, Strict()]


def _utf8(value: str) -> str:
    # JSON can carry lone surrogates ("\\ud800") that no tokenizer can encode.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
