"""Errors the HTTP server and the router answer with, all in the OpenAI shape.

Every failure a client can cause is a 4xx with `{"error": {"message", "type", "param", "code"}}`
whose message names the offending field: clients (the `openai` package, SGLang's frontend) show
that message to the user, so it must say what to fix. Only bugs answer 500.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("sglite.http")

# OpenAI's `type` for each status we answer with.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    """The body of an error: what went wrong and which request field caused it."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """An error answer (OpenAI shape)."""

    error: ErrorDetail


class APIError(Exception):
    """An error with its HTTP status, raised by route handlers and turned into an ErrorResponse."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body of this error."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {...}}` for a status and message."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSONResponse carrying an OpenAI-shaped error."""
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)(?::| must| is| has| holds| may)")


def param_of(message: str) -> str | None:
    """The field a validation message starts with ("top_p must be in (0, 1]" -> "top_p")."""
    m = _LEADING_NAME.match(message)
    return m.group(1) if m else None


def invalid_request(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError raised while validating a request, naming the field it is about.

    `rename` maps internal field names to the names the client used, so the message names the
    client's field.
    """
    message = str(exc) or type(exc).__name__
    for old, new in (rename or {}).items():
        message = re.sub(rf"\b{re.escape(old)}\b", new, message)
    return APIError(400, message, param=param_of(message))


def _describe_validation_error(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    kind = err.get("type", "")
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", "invalid JSON")
        return f"the request body is not valid JSON: {reason}", None
    if kind == "missing" and not loc:
        return "the request body is missing; send a JSON object", None
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return "the request body must be a JSON object", None
    # Union members add their type to the location (e.g. "prompt.str"); keep field names only.
    fields = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(fields) if fields else None
    msg = err.get("msg", "invalid value")
    if kind == "extra_forbidden":
        msg = "unknown field"
    given = err.get("input")
    detail = f"{param}: {msg}" if param else msg
    if kind not in ("missing", "extra_forbidden") and _short(given):
        detail += f" (got {json.dumps(given)})"
    return detail, param


def _is_type_tag(part: str) -> bool:
    # Field names here are snake_case; union members show up as "str", "list[int]",
    # "function-after[...]" or a model's class name.
    return part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper()


def _short(value: Any) -> bool:
    try:
        return value is not None and len(json.dumps(value)) <= 80
    except (TypeError, ValueError):
        return False


def install_error_handlers(
    app: FastAPI, bad_value: Callable[[ValueError], APIError] = invalid_request
) -> None:
    """Answer validation problems with 400, unknown routes with 404, bugs with 500 (all OpenAI
    shaped) instead of FastAPI's default 422 `{"detail": ...}` bodies.

    `bad_value` turns a ValueError a route raised into the error answered (a 400).
    """

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if not errors:
            return error_response(400, "invalid request")
        # A value that fits no member of a union fails once per member; the error with the
        # deepest location is the one that says what is wrong inside the value.
        described = [_describe_validation_error(e) for e in errors]
        depth = [len(e.get("loc", ())) for e in errors]
        message, param = described[depth.index(max(depth))]
        others = {p for _, p in described if p != param and not (param or "").startswith(f"{p}.")}
        if others:
            message += f" (also invalid: {', '.join(sorted(str(p) for p in others))})"
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        err = bad_value(exc)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
