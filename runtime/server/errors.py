"""OpenAI-shaped error bodies, and the field a request-validation error names."""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ifb.runtime.server.openai_responses import ErrorBody, ErrorInfo

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|[a-z-]+\[.*\])$")


class ModelNotFound(Exception):
    """The request names a model this server does not serve (404)."""


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "server_error")
    body = ErrorBody(error=ErrorInfo(message=message, type=kind, param=param, code=code or kind))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def validation_field(error: RequestValidationError) -> tuple[str, str]:
    """(field, message) of the first validation error, in OpenAI's words where it has them."""
    first = error.errors()[0]
    location: list[str] = []
    for part in first.get("loc", ()):
        if _UNION_TAG.match(str(part)):  # pydantic names the union member it tried: not a field
            break
        if part != "body":
            location.append(str(part))
    field = ".".join(location) or "body"
    if first.get("type") == "json_invalid":
        return "body", "request body is not valid JSON"
    if first.get("type") == "extra_forbidden":
        return field, f"unrecognized request argument supplied: {field}"
    return field, f"{field}: {first.get('msg', 'invalid value')}"
