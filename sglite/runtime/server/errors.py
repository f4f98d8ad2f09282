"""The server's own side of its errors: what each error status means on its routes (for the
OpenAPI schema) and the 400 for a request value the runtime rejects.

The error shape, `APIError` and the exception handlers are shared with the router in
`sglite.http.errors`.
"""

from __future__ import annotations

from typing import Any

from sglite.http.errors import APIError, ErrorResponse, invalid_request
from sglite.runtime.tokenizing.validation import ContextLengthError

# What each error status means on this server, for the OpenAPI schema.
_DESCRIPTIONS = {
    400: "invalid request: malformed JSON, a wrong type or out-of-range value, an unknown field "
    "or model, a prompt too long for the context, an invalid constraint (the message names the "
    "field)",
    401: "with --api-key: the key is missing or wrong",
    404: "not found",
    413: "the request body is larger than the server accepts",
    503: "overloaded (more than --max-queued-requests in flight; retry after Retry-After "
    "seconds), shutting down, or the model process is gone",
    504: "the request ran longer than --request-timeout",
}

# Clients should wait this many seconds before retrying (503 only).
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying (overload and shutdown)",
        "schema": {"type": "integer", "minimum": 0},
    }
}


def error_responses(
    *statuses: int, plain: bool = False, descriptions: dict[int, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries: each status answers an ErrorResponse (JSON).

    `descriptions` overrides the generic meaning of a status for one route. Every route also
    gets a `4XX` entry: any other client error (405 for a wrong method, ...) has the same shape,
    and documenting the range keeps FastAPI from advertising its default 422, which this server
    never sends (validation errors are 400s). `plain` is for routes whose success answer is not
    JSON: FastAPI would otherwise give their errors that media type too.
    """
    texts: dict[int | str, str] = {
        s: (descriptions or {}).get(s) or _DESCRIPTIONS[s] for s in statuses
    }
    texts["4XX"] = "any other client error (e.g. 405 for a wrong method), in the same shape"
    out: dict[int | str, dict[str, Any]] = {}
    for status, text in texts.items():
        entry: dict[str, Any] = {"description": text}
        if plain:
            ref = {"$ref": "#/components/schemas/ErrorResponse"}
            entry["content"] = {"application/json": {"schema": ref}}
        else:
            entry["model"] = ErrorResponse
        if status == 401:
            entry["headers"] = {
                "WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}
            }
        elif status == 503:
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    return out


def bad_request(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError raised while validating a request.

    `rename` maps runtime field names to the names the client used (the OpenAI API says
    `max_tokens` where the runtime says `max_new_tokens`), so the message names the client's field.
    """
    err = invalid_request(exc, rename)
    if isinstance(exc, ContextLengthError):
        err.code = "context_length_exceeded"
    return err
