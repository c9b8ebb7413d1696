"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, and the one
mapping of kvsched's gRPC status codes (kvsched.client's typed errors) to HTTP statuses."""

from __future__ import annotations

from typing import Any

import grpc

from kvsched.client import KvschedClientError

# gRPC code -> (HTTP status, OpenAI error type). The one place kvsched's statuses are mapped.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    """An error answered to the HTTP client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else str(self.status),
            }
        }


def invalid(message: str, param: str | None = None) -> ApiError:
    """400: the request cannot be served as written."""
    return ApiError(400, message, "invalid_request_error", param)


def model_not_found(model: str, known: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model {model!r} does not exist; served: {', '.join(known) or 'none'}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def from_client_error(exc: KvschedClientError) -> ApiError:
    """The HTTP answer for a failed kvsched call (the daemon's message kept: it names the field
    or the limit at fault). Unknown codes are 500."""
    status, type_ = _GRPC_TO_HTTP.get(exc.code, (500, "internal_error"))
    code = {404: "model_not_found"}.get(status) if "model" in exc.message else None
    return ApiError(status, f"kvsched: {exc.message}", type_, None, code or exc.code.name.lower())
