"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, and the one
mapping of kvsched's gRPC status codes (kvsched.client's typed errors) to HTTP statuses."""

from __future__ import annotations

import re
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


# The daemon's refusals name the request ("request 'abc': ...", an id the HTTP client may never
# have seen) and then the field at fault in the contract's words; the OpenAI param for each.
_REQUEST_PREFIX = re.compile(r"^request '[^']*': ")
_PARAMS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), param)
    for pattern, param in (
        (r"^prompt (of \d+ tokens exceeds|\(\d+ tokens\) \+ max_tokens)", "input_tokens"),
        (r"^a prompt of \d+ tokens needs", "input_tokens"),
        (r"^prompt_logprobs", "prompt_logprobs"),
        (r"^logprobs", "logprobs"),
        (r"^max_tokens", "max_tokens"),
        (r"^min_tokens", "min_tokens"),
        (r"^prompt", "prompt"),
        (r"^token ids", "prompt"),
        (r"stop_token_ids", "stop_token_ids"),
        (r"logit_bias", "logit_bias"),
        (r"^presence_penalty", "presence_penalty"),
        (r"^frequency_penalty", "frequency_penalty"),
        (r"^repetition_penalty", "repetition_penalty"),
        (r"^min_p", "min_p"),
        (r"^structured_output", "structured_output"),  # the front end names its source field
        (r"temperature", "temperature"),
        (r"^request_id", "request_id"),
        (r"model", "model"),
        (r"^priority", "priority"),
    )
)


def daemon_param(message: str) -> tuple[str, str | None]:
    """The daemon's refusal message without the request id it starts with, and the OpenAI
    parameter it is about (None when it names none)."""
    text = _REQUEST_PREFIX.sub("", message)
    return text, next((param for rx, param in _PARAMS if rx.search(text)), None)


def from_client_error(exc: KvschedClientError) -> ApiError:
    """The HTTP answer for a failed kvsched call: the daemon's message (it names the field or
    the limit at fault), without the request id, and `param` naming the field. Unknown codes
    are 500."""
    status, type_ = _GRPC_TO_HTTP.get(exc.code, (500, "internal_error"))
    message, param = daemon_param(exc.message)
    code = {404: "model_not_found"}.get(status) if "model" in exc.message else None
    if status not in (400, 404):
        param = None
    return ApiError(status, f"kvsched: {message}", type_, param, code or exc.code.name.lower())
