"""Typed errors of kvsched.client: every failed call raises a KvschedClientError subclass that
carries the gRPC status code and the daemon's message (which names the field or the id at fault),
so a front end can map a refusal to its own API (400, 404, 429, 503, 401, 403) without grpc."""

from __future__ import annotations

from typing import Any

import grpc


class KvschedClientError(Exception):
    """A call to the daemon failed. `code` is the grpc.StatusCode, `message` the daemon's
    text, `request_id` the request concerned when one is known."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, request_id: str = ""
    ) -> None:
        super().__init__(f"{(code or self.code).name}: {message}")
        if code is not None:
            self.code = code
        self.message = message
        self.request_id = request_id


class InvalidArgument(KvschedClientError):
    """The request is malformed: an empty prompt, a negative value, a duplicate id, too long."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyLive(InvalidArgument):
    """A Generate whose request id names a live request that is this same request (same
    model, same prompt): an earlier submit of it was accepted (e.g. through another daemon,
    after this client had given up waiting for its answer). Resume follows it; nothing is
    submitted twice. The daemon marks it with `kvsched-error: RequestAlreadyLive` in the
    call's trailing metadata (any client language can read it)."""


class NotFound(KvschedClientError):
    """An unknown request id (Abort) or instance id (status)."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(KvschedClientError):
    """The daemon's queue is full: retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvschedClientError):
    """The daemon is draining, or cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class NoAnswer(Unavailable):
    """A call got no first answer within the bound it was given (`first_answer_timeout`): the
    daemon is paused, hung or cut off (its kernel may still accept TCP, so the connection
    alone never fails). The call was cancelled; try another daemon."""


class Unauthenticated(KvschedClientError):
    """No token, or one the daemon does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvschedClientError):
    """A known token whose role may not call this service (a client token on AdminService)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(KvschedClientError):
    """The call's timeout passed; a Generate stream cut so is aborted by the daemon."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(KvschedClientError):
    """The call was cancelled on this side (GenerateStream.cancel, Session.cancel)."""

    code = grpc.StatusCode.CANCELLED


_BY_CODE: dict[grpc.StatusCode, type[KvschedClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        DeadlineExceeded,
        Cancelled,
    )
}
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_for(
    code: grpc.StatusCode | int, message: str, request_id: str = ""
) -> KvschedClientError:
    """The typed error for a status code (a grpc.StatusCode, or its number as a Session
    stream's `errors` entries carry it)."""
    if isinstance(code, int):
        code = _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, KvschedClientError)
    return cls(message, code, request_id)


ERROR_TYPE_KEY = "kvsched-error"  # the daemon's error type, in a failed call's trailing metadata


def from_rpc_error(exc: Any, request_id: str = "") -> KvschedClientError:
    """The typed error for a grpc.RpcError / grpc.aio.AioRpcError."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT and _error_type(exc) == "RequestAlreadyLive":
        return AlreadyLive(details or "", code, request_id)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "", request_id)


def _error_type(exc: Any) -> str:
    """The `kvsched-error` entry of a failed call's trailing metadata ("" if none)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        entries = trailing() if callable(trailing) else None
    except Exception:  # a call that never got its trailers
        return ""
    for key, value in entries or ():
        if key == ERROR_TYPE_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""
