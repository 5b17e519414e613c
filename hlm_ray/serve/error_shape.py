"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: what the
proxy's guard, the connection guard and the application all answer with.

    error_body(404, "GET /x: not found")   # -> bytes of the JSON body
"""

from __future__ import annotations

import json

# The `code` of an error with no more specific one (OpenAI's where it has one).
ERROR_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "unknown_url",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    422: "invalid_value",
    500: "internal_error",
    503: "server_overloaded",
    504: "timeout",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    code = code or ERROR_CODES.get(status, f"http_{status}")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return json.dumps(body).encode()
