"""What the OpenAI routes share before generating: request checks, the output constraint, sampling
parameters and admission (running the choices: `openai_choices.py`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from sglite.http.errors import APIError
from sglite.runtime.constrained.base import GrammarError
from sglite.runtime.server.errors import bad_request
from sglite.runtime.server.openai_protocol import ResponseFormat, _SamplingExtras
from sglite.runtime.server.serving import prepare_requests
from sglite.runtime.server.state import ServerState
from sglite.runtime.tokenizing.request import GenerateRequest

# Statuses the generating routes really answer besides 200 (401 with --api-key, 413 from the body
# size limit, 503 from admission, 504 from --request-timeout).
GENERATE_ERRORS_CODES = (400, 401, 413, 503, 504)
# Runtime field names in validation messages -> the names OpenAI clients sent.
_RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def check_common(state: ServerState, body: _SamplingExtras) -> None:
    """400 (404 for the model) for what neither OpenAI route serves."""
    state.check_model(body.model)
    if body.logit_bias:
        raise APIError(
            400, "logit_bias: not supported yet", param="logit_bias", code="not_supported"
        )


@dataclass(frozen=True)
class OutputConstraint:
    """The request's output constraint: runtime `kind` and text, and the field it came from."""

    kind: str  # regex, ebnf or json_schema (the runtime's sampling parameter)
    text: str
    field: str  # what the client set: regex, ebnf, json_schema or response_format...


def output_constraint(body: _SamplingExtras) -> OutputConstraint | None:
    """The one constraint of a request (SGLang's extras or `response_format`), else None.

    Two at once answer 400 naming both: the runtime enforces one grammar per request.
    """
    found: list[OutputConstraint] = []
    for key in ("regex", "ebnf", "json_schema"):
        value = getattr(body, key)
        if value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            found.append(OutputConstraint(key, text, key))
    if body.response_format is not None:
        schema = response_format_schema(body.response_format)
        if schema is not None:
            found.append(OutputConstraint("json_schema", schema[0], schema[1]))
    if len(found) > 1:
        names = [c.field.split(".")[0] for c in found]
        raise APIError(
            400,
            f"{names[1]}: cannot be combined with {names[0]}; a request takes at most one "
            "constraint (regex, ebnf, json_schema or a JSON response_format)",
            param=names[1],
        )
    return found[0] if found else None


def response_format_schema(fmt: ResponseFormat) -> tuple[str, str] | None:
    """(JSON schema text, field it came from) for a JSON `response_format`; None for `text`."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"}), "response_format"
    spec = fmt.json_schema
    if spec is None:
        raise APIError(
            400,
            "response_format.json_schema: required when type is json_schema "
            '(e.g. {"name": "answer", "schema": {...}, "strict": true})',
            param="response_format.json_schema",
        )
    field = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if schema is None:
        raise APIError(400, f"{field}: missing; give the JSON schema of the output", param=field)
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"{field}: must be a JSON schema object", param=field)
    return json.dumps(schema), field


def sampling_params(
    body: _SamplingExtras, max_new_tokens: int | None, constraint: OutputConstraint | None
) -> dict[str, Any]:
    """The runtime's `sampling_params` of a request; fields the client left unset are absent."""
    params = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": body.min_tokens,
        "n": body.n,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "no_stop_trim": body.no_stop_trim,
        "seed": body.seed,
        "close_structure_on_length": body.close_structure_on_length,
    }
    if constraint is not None:
        params[constraint.kind] = constraint.text
    return {k: v for k, v in params.items() if v is not None}


def prepare(
    state: ServerState, default_param: str, constraint: OutputConstraint | None, **kwargs: Any
) -> list[GenerateRequest]:
    """Validate and admit the scheduler requests; a ValueError becomes a 400 naming the field the
    client set (`default_param` when the message names none)."""
    try:
        reqs, _ = prepare_requests(state, **kwargs)
    except ValueError as exc:
        err = bad_request(exc, _RENAME)
        grammar = isinstance(exc, GrammarError) and constraint is not None
        if grammar and exc.kind == constraint.kind:  # type: ignore[union-attr]
            # An invalid grammar: keep the parser's message, name the field the client set.
            err.param = constraint.field
            if constraint.field != constraint.kind:
                err.message = f"{constraint.field}: {err.message}"
        elif err.param is None:
            err.param = default_param
        raise err from None
    return reqs


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token the sampling parameters ruled out) and NaN become
    -9999.0, as the native API writes them; pydantic would write `null`, which the schema and
    OpenAI clients do not allow."""
    return logprob if math.isfinite(logprob) else -9999.0
