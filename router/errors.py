"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with a status.

Every failure the router reports to a client goes through `APIError`, so a client library sees the
same fields it gets from OpenAI (the `openai` package raises `BadRequestError`, `RateLimitError`, ...
from the status and reads `error.message`).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client; `headers` carries e.g. `Retry-After` for a 429."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, code=code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def _whole_seconds(seconds: float) -> str:
    # Retry-After is whole seconds (RFC 9110); round up so a client never comes back too early.
    return str(max(1, int(-(-seconds // 1))))


def rate_limited(message: str, retry_after_seconds: float, code: str = "rate_limit_exceeded") -> APIError:
    return APIError(429, message, type="rate_limit_error", code=code,
                    headers={"Retry-After": _whole_seconds(retry_after_seconds)})


def unavailable(message: str, code: str = "service_unavailable", retry_after_seconds: float = 1.0) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code,
                    headers={"Retry-After": _whole_seconds(retry_after_seconds)})


def upstream_error(message: str, code: str = "upstream_error") -> APIError:
    return APIError(502, message, type="server_error", code=code)


def timeout_error(message: str) -> APIError:
    return APIError(504, message, type="server_error", code="timeout")
