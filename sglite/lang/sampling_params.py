"""The sampling parameters of a generation (`SglSamplingParams`) and the regexes behind `dtype=`.

A `gen` carries parameters where unset fields are None; the interpreter merges them over the
defaults given to `run()` (`merged_with`), and backends turn the result into a request
(`to_srt_kwargs`, `request_kwargs`). Invariant: this module depends on no other part of the
language, so the IR (`ir.py`, which re-exports these names under SGLang's import path), the
interpreter and every backend can import it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

# The regexes behind `dtype=` (SGLang's): a generation of that type is constrained to them.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# Sampling fields a `gen` may override; None on a gen means "use the run's default".
_OVERRIDABLE = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex",
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "ignore_eos", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "dtype", "regex", "json_schema", "ebnf",
)  # fmt: skip


@dataclasses.dataclass
class SglSamplingParams:
    """Sampling parameters of one generation, in SGLang's names.

    On a `gen` every field may be None ("not set"); the interpreter fills unset fields from the
    defaults given to `run()` (`merged_with`). `dtype`, `regex` and `json_schema` constrain the
    output; the logprob fields are request options rather than sampling options.
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int | None = 0
    n: int | None = 1
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    stop_regex: str | Sequence[str] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1  # -1 = off
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    ignore_eos: bool | None = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: type | str | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # a grammar (GBNF, or Lark for llguidance): tool calls use it

    @classmethod
    def unset(cls, **values: Any) -> SglSamplingParams:
        """Parameters where every field not given is None (the form a `gen` carries)."""
        fields = {f.name: None for f in dataclasses.fields(cls)}
        fields.update(values)
        return cls(**fields)

    def clone(self) -> SglSamplingParams:
        """A deep copy (stop lists are mutated when a chat template adds its stop string)."""
        return copy.deepcopy(self)

    def merged_with(self, override: SglSamplingParams) -> SglSamplingParams:
        """These defaults with every field `override` sets (not None) replaced."""
        merged = self.clone()
        for name in _OVERRIDABLE:
            value = getattr(override, name)
            if value is not None:
                setattr(merged, name, copy.deepcopy(value))
        return merged

    def stop_list(self) -> list[str]:
        """`stop` as a list of strings."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    def to_srt_kwargs(self) -> dict[str, Any]:
        """The `sampling_params` object of a native `/generate` request (unset fields dropped)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "n": self.n,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids or []),
            "stop_regex": self.stop_regex,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
        }
        # Defaults that mean "off" are dropped too, so servers that predate a field still work.
        if out["min_new_tokens"] == 0:
            del out["min_new_tokens"]
        if out["n"] == 1:
            del out["n"]
        return {k: v for k, v in out.items() if v is not None and v != []}

    def request_kwargs(self) -> dict[str, Any]:
        """The top-level logprob options of a `/generate` request (only those set)."""
        names = (
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
        )
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}
