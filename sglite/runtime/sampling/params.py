"""Sampling parameters of one request, with SGLang's names, defaults and validation.

Clients (SGLang's own frontend, the OpenAI adapters) send every field literally, defaults
included, so `None` and empty lists mean "unset" rather than "invalid". Everything else is checked
here, once, at admission: a bad value raises `ValueError` naming the field and its allowed range,
which the server turns into a 400 instead of failing inside the decode loop.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from sglite.runtime.constrained.base import GrammarError

# Below this temperature sampling is indistinguishable from argmax, and dividing by it would
# overflow float32 logits; SGLang uses the same cut.
GREEDY_TEMPERATURE_EPS = 1e-6
# Smallest repetition penalty. The sampler divides repeated tokens' positive logits by the
# penalty in float32; a penalty near float32's underflow (5e-324, 1e-40) turns them into inf and
# the distribution into NaN, which crashed the sampler's batch. Far above that, any penalty this
# small already makes repeating certain, so the floor rules out no useful setting.
MIN_REPETITION_PENALTY = 1e-6


@dataclass
class SamplingParams:
    """How one request samples and when it stops (SGLang's `sampling_params`)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    seed: int | None = None
    # A constrained request whose output budget is nearly spent closes its structure (strings,
    # arrays, objects) so that an answer cut by max_new_tokens still parses (finish "length").
    close_structure_on_length: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Parse and validate a client's `sampling_params` object.

        `None` values and empty lists leave the default in place; unknown keys, wrong types and
        out-of-range values raise `ValueError` naming the field.
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
                continue
            kwargs[key] = _PARSERS[key](key, value)
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        """Check ranges and cross-field rules; raises `ValueError` naming the field."""
        _check(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", self.max_new_tokens)
        _check(self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0", self.min_new_tokens)
        _check(
            self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be <= max_new_tokens ({self.max_new_tokens})",
            self.min_new_tokens,
        )
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1 (off) or >= 0", self.top_k)
        if self.top_k == 0:  # OpenAI-style clients use 0 for "off"; store one spelling
            self.top_k = -1
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, 2]",
            self.repetition_penalty,
        )
        for s in self.stop:
            _check(len(s) > 0, "stop", "stop strings must be non-empty", s)
        for t in self.stop_token_ids:
            _check(t >= 0, "stop_token_ids", "token ids must be >= 0", t)
        for pattern in self.stop_regex:
            _check(len(pattern) > 0, "stop_regex", "patterns must be non-empty", pattern)
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex: {pattern!r} does not compile: {e}") from None
            # A pattern that matches the empty string would stop every request at once.
            _check(
                compiled.fullmatch("") is None,
                "stop_regex",
                "patterns must not match the empty string",
                pattern,
            )
        constraints = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(constraints) > 1:
            raise GrammarError(
                f"{constraints[0]}: at most one of regex, json_schema and ebnf may be set "
                f"(got {', '.join(constraints)})",
                constraints[0],
            )
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise GrammarError(f"json_schema: not valid JSON: {e}", "json_schema") from None

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-able values; `from_dict(p.to_dict()) == p`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, list) else value
        return out

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_constraint(self) -> bool:
        """True when a grammar (regex, json_schema or ebnf) constrains the output."""
        return self.regex is not None or self.json_schema is not None or self.ebnf is not None

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraining the output, or None."""
        for kind in ("regex", "json_schema", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")


def _int(name: str, value: Any) -> int:
    # bool is an int subclass; `"max_new_tokens": true` is a client bug, not 1.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():  # JSON encoders may write 128.0
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _json_schema(name: str, value: Any) -> str:
    # The protocol says "a JSON string", but a schema object is unambiguous; accept both.
    if isinstance(value, dict):
        return json.dumps(value)
    return _str(name, value)


def _str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"{name} must be a string or a list of strings, got item {item!r}")
    return list(value)


def _int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return [_int(name, item) for item in value]


def _seed(name: str, value: Any) -> int:
    # Any integer is a valid seed (OpenAI allows negatives); the generator takes it mod 2**64.
    return _int(name, value)


_PARSERS = {
    "max_new_tokens": _int,
    "min_new_tokens": _int,
    "n": _int,
    "stop": _str_list,
    "stop_token_ids": _int_list,
    "stop_regex": _str_list,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "regex": _str,
    "json_schema": _json_schema,
    "ebnf": _str,
    "seed": _seed,
    "close_structure_on_length": _bool,
}
