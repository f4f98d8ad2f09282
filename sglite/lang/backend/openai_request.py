"""What is sent to an OpenAI-compatible endpoint: the client, the sampling fields of a request.

`make_client` builds the `openai` client (imported only here and only when a backend is made:
the language itself needs no HTTP client); `sampling_kwargs` and `sampling_extras` map
`SglSamplingParams` to OpenAI's own fields and to the SGLang / vLLM extra body fields, sending
only what differs from the defaults so endpoints that lack a field are not sent it;
`is_bad_request` and `drop_regex` let the backend retry a request the endpoint refused.
"""

from __future__ import annotations

import os
from typing import Any

from sglite.lang.sampling_params import SglSamplingParams


def make_client(
    base_url: str | None, api_key: str | None, is_azure: bool, kwargs: dict[str, Any]
) -> Any:
    try:
        import openai
    except ImportError as exc:  # the language itself needs no HTTP client
        raise ImportError("sgl.OpenAI needs the openai package: pip install openai") from exc
    if is_azure:  # SGLang's option: Azure's endpoint and credentials come in kwargs
        return openai.AzureOpenAI(api_key=api_key, **kwargs)
    if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
        api_key = "EMPTY"  # local servers without --api-key ignore it; the client insists
    return openai.OpenAI(base_url=base_url, api_key=api_key, **kwargs)


def is_bad_request(exc: BaseException) -> bool:
    """Whether `exc` is the endpoint refusing the request (HTTP 400 / 422)."""
    return getattr(exc, "status_code", None) in (400, 422)


def drop_regex(kwargs: dict[str, Any]) -> None:
    extra = kwargs.get("extra_body")
    if extra:
        extra.pop("regex", None)


def sampling_kwargs(params: SglSamplingParams) -> dict[str, Any]:
    """OpenAI's own sampling fields (penalties only when set, as some endpoints refuse them)."""
    out: dict[str, Any] = {}
    if params.temperature is not None:
        out["temperature"] = params.temperature
    if params.top_p is not None and params.top_p != 1.0:
        out["top_p"] = params.top_p
    if params.frequency_penalty:
        out["frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        out["presence_penalty"] = params.presence_penalty
    return out


def sampling_extras(params: SglSamplingParams) -> dict[str, Any]:
    """SGLang / vLLM extra fields (sent in the body only when they differ from the defaults,
    so endpoints without them, such as OpenAI, are not sent what they would refuse)."""
    extra: dict[str, Any] = {}
    if params.top_k not in (None, -1, 0):
        extra["top_k"] = params.top_k
    if params.min_p:
        extra["min_p"] = params.min_p
    if params.min_new_tokens:
        extra["min_tokens"] = params.min_new_tokens
    if params.ignore_eos:
        extra["ignore_eos"] = True
    if params.stop_token_ids:
        extra["stop_token_ids"] = list(params.stop_token_ids)
    return extra
