"""Backends: what executes a program's generations.

`BaseBackend` is SGLang's backend interface (every method the interpreter may call).
`NativeBackend` implements it on SGLang's native `/generate` protocol through two primitives,
`_request(payload)` and `_request_stream(payload)`; the in-process Engine backend and the HTTP
`RuntimeEndpoint` differ only in how they deliver a payload, so both make byte-identical requests
and reach identical decisions (`select` in particular).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglite.lang.chat_template import ChatTemplate, get_chat_template
from sglite.lang.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from sglite.lang.sampling_params import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    SglSamplingParams,
)

if TYPE_CHECKING:
    from sglite.lang.stream_executor import StreamExecutor

logger = logging.getLogger(__name__)

# What a runtime without constrained decoding (sglite before it had one) answers to regex /
# json_schema (see is_unsupported_constraint).
UNSUPPORTED_CONSTRAINT = "constrained decoding is not supported"


def is_unsupported_constraint(exc: BaseException) -> bool:
    """Whether `exc` is the runtime refusing a regex / json_schema constraint."""
    return UNSUPPORTED_CONSTRAINT in str(exc)


def apply_dtype(params: SglSamplingParams) -> bool:
    """Turn `dtype` into its regex (and stop strings, for numbers), as SGLang does; `params` is
    changed in place.

    Returns whether the request's regex came from `dtype` (and may be dropped when the
    runtime cannot enforce it).
    """
    dtype = params.dtype
    if dtype is None:
        return False
    stops = params.stop_list()
    if dtype in ("int", int):
        regex, stops = REGEX_INT, stops + [" ", "\n"]
    elif dtype in ("float", float):
        regex, stops = REGEX_FLOAT, stops + [" ", "\n"]
    elif dtype in ("str", str):
        regex = REGEX_STR
    elif dtype in ("bool", bool):
        regex = REGEX_BOOL
    else:
        raise ValueError(f"invalid dtype {dtype!r}: use int, float, str or bool")
    if params.regex is not None:
        warnings.warn("both dtype and regex are set; dtype is used", stacklevel=3)
    params.stop = stops
    params.regex = regex
    return True


class BaseBackend:
    """The interface the interpreter drives. Every hook has a harmless default except the
    generation calls, which a real backend must implement."""

    def __init__(self) -> None:
        self.support_concate_and_append = False
        self.is_chat_model = False
        self.chat_template: ChatTemplate = get_chat_template("default")

    def get_model_name(self) -> str:
        raise NotImplementedError

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def cache_prefix(self, prefix_str: str) -> None:
        """Fill the runtime's cache with `prefix_str` (no output)."""

    def uncache_prefix(self, rid: str) -> None:
        pass

    def end_request(self, rid: str | list[str]) -> None:
        pass

    def begin_program(self, s: StreamExecutor) -> None:
        pass

    def end_program(self, s: StreamExecutor | list[StreamExecutor]) -> None:
        pass

    def commit_lazy_operations(self, s: StreamExecutor) -> None:
        """Send the program's text so far to the runtime (before a fork)."""

    def fork_program(
        self, src: StreamExecutor, dst: list[StreamExecutor], position_ids_offset: Any = None
    ) -> None:
        pass

    def fill_image(self, s: StreamExecutor) -> None:
        pass

    def generate(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        """Continue `s.text_`; returns (text, meta_info), or lists of them when `n > 1`."""
        raise NotImplementedError

    def generate_stream(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Continue `s.text_`, yielding (new text, meta_info so far) as tokens arrive."""
        raise NotImplementedError

    def select(
        self,
        s: StreamExecutor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod | None = None,
    ) -> ChoicesDecision:
        """Pick one of `choices` as the continuation of `s.text_`."""
        raise NotImplementedError

    def new_api_speculation(self, num_api_spec_tokens: int) -> Any:
        """Per-program-state API speculative execution (`@sgl.function(num_api_spec_tokens=N)`),
        or None when the backend does not do it (native backends: the radix cache already makes
        the extra calls cheap). See `api_speculative.ApiSpeculation` for the interface."""
        return None

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    def flush_cache(self) -> Any:
        pass

    def get_server_info(self) -> Any:
        pass


class NativeBackend(BaseBackend):
    """A backend speaking SGLang's native `/generate` protocol.

    Subclasses implement `_request(payload) -> dict | list[dict]` (one result per prompt, as the
    server answers) and `_request_stream(payload) -> Iterator[dict]` (cumulative results, one per
    step), and raise an exception whose text carries the runtime's message on failure.
    """

    def __init__(self) -> None:
        super().__init__()
        # Whether the runtime enforces regex constraints (sglite's and SGLang's do); learnt from
        # the first refusal, so `dtype=` generations (gen_int, gen_string) on a runtime without
        # constrained decoding fall back to plain generation.
        self._constraints_supported: bool | None = None
        self._warn_lock = threading.Lock()

    # ------------------------------------------------------------------ transport
    def _request(self, payload: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    # ------------------------------------------------------------------ cache
    def cache_prefix(self, prefix_str: str) -> None:
        if prefix_str:
            self._request({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, s: StreamExecutor) -> None:
        # A prefill-only request: the text so far enters the radix cache, so every branch of a
        # fork that follows hits it instead of recomputing it.
        if s.text_:
            payload = {"text": s.text_, "sampling_params": {"max_new_tokens": 0}}
            self._request(_with_images(payload, s))

    # ------------------------------------------------------------------ generation
    def generate(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        payload, from_dtype = self._generate_payload(s.text_, sampling_params)
        _with_images(payload, s)
        result = self._with_constraint_fallback(payload, from_dtype, self._request)
        if isinstance(result, list):  # n > 1
            return [r["text"] for r in result], [r["meta_info"] for r in result]
        return result["text"], result["meta_info"]

    def generate_stream(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        payload, from_dtype = self._generate_payload(s.text_, sampling_params)
        _with_images(payload, s)
        payload["stream"] = True

        def start(p: dict[str, Any]) -> tuple[Iterator[dict[str, Any]], dict[str, Any] | None]:
            it = iter(self._request_stream(p))
            return it, next(it, None)  # the first chunk surfaces request errors

        chunks, first = self._with_constraint_fallback(payload, from_dtype, start)
        pos = 0
        while first is not None:
            text = first["text"]
            yield text[pos:], first["meta_info"]
            pos = len(text)
            first = next(chunks, None)

    def _generate_payload(
        self, text: str, sampling_params: SglSamplingParams
    ) -> tuple[dict[str, Any], bool]:
        params = sampling_params.clone()
        from_dtype = self._apply_dtype(params)
        payload: dict[str, Any] = {"text": text, "sampling_params": params.to_srt_kwargs()}
        payload.update(params.request_kwargs())
        return payload, from_dtype

    def _apply_dtype(self, params: SglSamplingParams) -> bool:
        return apply_dtype(params)

    def _with_constraint_fallback(
        self, payload: dict[str, Any], from_dtype: bool, call: Any
    ) -> Any:
        """`call(payload)`; a `dtype` regex the runtime cannot enforce is dropped (with one
        warning) rather than failing the program. Explicit `regex=`/`json_schema=` still fail."""
        if from_dtype and self._constraints_supported is False:
            payload["sampling_params"].pop("regex", None)
            return call(payload)
        try:
            return call(payload)
        except Exception as exc:
            if not (from_dtype and is_unsupported_constraint(exc)):
                raise
            with self._warn_lock:
                if self._constraints_supported is None:
                    warnings.warn(
                        "the runtime does not support constrained decoding: dtype= "
                        "generations (gen_int, gen_string) run unconstrained",
                        stacklevel=2,
                    )
                self._constraints_supported = False
            payload["sampling_params"].pop("regex", None)
            return call(payload)

    # ------------------------------------------------------------------ select
    def select(
        self,
        s: StreamExecutor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod | None = None,
    ) -> ChoicesDecision:
        """Score each choice by its tokens' logprobs after `s.text_` and let `choices_method`
        decide (default: mean token logprob).

        Requests (protocol.md, "How select uses it"): a prefill-only request of the prefix gives
        its token count P and caches it; one batch request of prefix + choice with
        `logprob_start_len = P - 2` returns the logprobs of the boundary and the choice tokens.
        A choice's tokens are those after position P, or from P - 1 when the prefix's last token
        merged with the choice's first characters (re-tokenization at the boundary, "token
        healing"). Null logprobs never count.
        """
        if temperature > 1e-5:
            raise ValueError("select does not sample: its temperature must be 0")
        method = choices_method or token_length_normalized
        prefix = s.text_
        if prefix:
            probe = {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
            probe = self._request(_with_images(probe, s))
            prompt_len = int(probe["meta_info"]["prompt_tokens"])
        else:
            prompt_len = 0
        start = max(prompt_len - 2, 0)
        batch = {
            "text": [prefix + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        }
        if s.images_:
            batch["image_data"] = [list(s.images_) for _ in choices]
        results = self._request(batch)
        input_token_logprobs = [
            _choice_entries(r["meta_info"]["input_token_logprobs"], prompt_len - start, c)
            for r, c in zip(results, choices)
        ]
        output_token_logprobs = [r["meta_info"].get("output_token_logprobs", []) for r in results]
        normalized = [mean_logprob(entries) for entries in input_token_logprobs]

        unconditional = None
        if method.requires_unconditional_logprobs:
            uncond = self._request(
                {
                    "input_ids": [[e[1] for e in entries] for entries in input_token_logprobs],
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                }
            )
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in uncond]
        return method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=output_token_logprobs,
            unconditional_token_logprobs=unconditional,
        )


def _choice_entries(entries: list[list[Any]], offset: int, choice: str) -> list[list[Any]]:
    """The logprob entries of `choice`'s own tokens.

    `entries[offset:]` are the tokens after the prefix's length. When their text is not exactly
    the choice, the boundary token was re-tokenized together with the choice, so it belongs to
    the choice too. Entries with a null logprob (the first token of an empty prefix) are dropped.
    """
    own = entries[offset:]
    texts = [e[2] for e in own]
    if offset > 0 and (None in texts or "".join(texts) != choice):
        own = entries[offset - 1 :]
    return [list(e) for e in own if e[0] is not None]


def mean_logprob(entries: list[list[Any]]) -> float:
    """Mean logprob of `entries` ([logprob, id, text]), skipping null ones; -inf when empty."""
    values = [float(e[0]) for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


def _with_images(payload: dict[str, Any], s: StreamExecutor) -> dict[str, Any]:
    """`payload` with the program's images (`sgl.image`) as `image_data` and its segments
    (`sgl.segment`) as `segments` (character spans of its text), when it has any."""
    if s.images_:
        payload["image_data"] = list(s.images_)
    if s.segments_ and isinstance(payload.get("text"), str):
        payload["segments"] = [list(span) for span in s.segments_]
    return payload
