"""Typed errors -> gRPC status codes, in one place (the codes: protos/kvsched/v1/*.proto).

Servicers raise the typed errors of `kvsched.core.errors` (or the two below); `ErrorInterceptor`
turns whatever escapes a handler into a status with an actionable message, for unary and
streaming handlers alike, also after a stream has sent messages. Inside a stream that carries many
requests (Session), an error about one request is reported in-band: `status_for(exc)` gives the
same code and message the interceptor would.

Anything else is a bug: the client sees INTERNAL with a reference, the log has the traceback.
"""

from __future__ import annotations

import inspect
import logging
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from kvsched.core.errors import (
    CapacityExceeded,
    ConfigError,
    InvalidRequest,
    KvschedError,
    ProtocolError,
    RequestNotFound,
    Unavailable,
)

__all__ = [
    "ERROR_TYPE_KEY",
    "DeadlinePassed",
    "ErrorInterceptor",
    "PermissionDenied",
    "Unauthenticated",
    "status_for",
]

log = logging.getLogger(__name__)

ERROR_TYPE_KEY = "kvsched-error"
"""Trailing-metadata key carrying the error's class name (e.g. 'CapacityExceeded')."""


class Unauthenticated(KvschedError):
    """No valid credentials: missing or unknown token, bad client certificate (UNAUTHENTICATED)."""


class PermissionDenied(KvschedError):
    """The caller is known but may not do this, e.g. a front-end token on AdminService."""


class DeadlinePassed(KvschedError):
    """The call's own gRPC deadline passed and its request was aborted for it: the stream ends
    with DEADLINE_EXCEEDED, as the client's runtime reports it, never with a Finished."""


_CODES: dict[type[BaseException], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    RequestNotFound: grpc.StatusCode.NOT_FOUND,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ProtocolError: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    DecodeError: grpc.StatusCode.INVALID_ARGUMENT,  # bytes that are not the RPC's message
}

_DEFAULT_MESSAGES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid argument",
    grpc.StatusCode.NOT_FOUND: "not found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "capacity exceeded; retry later",
    grpc.StatusCode.FAILED_PRECONDITION: "protocol error",
    grpc.StatusCode.UNAVAILABLE: "unavailable; retry later",
    grpc.StatusCode.UNAUTHENTICATED: "authentication required",
    grpc.StatusCode.PERMISSION_DENIED: "permission denied",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline exceeded",
}


def _code_of(exc: BaseException) -> grpc.StatusCode | None:
    for cls in type(exc).__mro__:  # the nearest mapped base wins: subclasses keep their code
        code = _CODES.get(cls)
        if code is not None:
            return code
    return None


def status_for(exc: BaseException, where: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and message a client should see for `exc`.

    A typed error keeps its own message. Anything else is logged here with its traceback and a
    short reference, and becomes INTERNAL with a message that shows only that reference.
    `where` (e.g. the RPC method) goes into the log line.
    """
    code = _code_of(exc)
    if isinstance(exc, DecodeError):
        return code or grpc.StatusCode.INVALID_ARGUMENT, (
            f"malformed message: the bytes do not decode as this RPC's protobuf ({exc})"
        )
    if code is not None:
        return code, str(exc) or _DEFAULT_MESSAGES[code]
    ref = uuid.uuid4().hex[:12]
    log.error(
        "unexpected %s in %s (ref %s)",
        type(exc).__name__,
        where or "handler",
        ref,
        exc_info=exc,
        extra={"error_ref": ref},
    )
    return grpc.StatusCode.INTERNAL, f"internal error (ref {ref}); the daemon log has the details"


def _release(exc: BaseException) -> None:
    """Let go of what a failed call's frames hold (its request above all) now: the abort that
    follows chains `exc`, whose traceback would keep a refused 60 MB request alive until the
    cycle collector runs, hundreds of requests later. The caller drops its `request` too."""
    traceback.clear_frames(exc.__traceback__)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception, where: str) -> None:
    code, message = status_for(exc, where)
    trailer = () if code is grpc.StatusCode.INTERNAL else ((ERROR_TYPE_KEY, type(exc).__name__),)
    await context.abort(code, message, trailer)


Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]


def _wrap_unary_response(behavior: Behavior, where: str) -> Behavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except grpc.aio.AbortError:
            raise  # the handler called context.abort itself
        except Exception as exc:
            _release(exc)
            request = None  # the failed request is let go of now (see _release)
            await _abort(context, exc, where)

    return handler


def _wrap_stream_response(behavior: Behavior, where: str) -> Behavior:
    # A streaming handler is either an async generator or a coroutine that calls context.write().
    async def handler(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        result = None
        try:
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            elif inspect.isawaitable(result):
                await result
            else:
                for response in result or ():
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            _release(exc)
            request = None  # the failed request is let go of now (see _release)
            await _abort(context, exc, where)
        finally:
            # A cancelled call (the client went away) closes the handler's generator now, so its
            # `finally` (e.g. abort the request) runs at once rather than whenever it is collected.
            if inspect.isasyncgen(result):
                await result.aclose()

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Maps exceptions escaping any handler to status codes (see `status_for`).

    Install it first in `grpc.aio.server(interceptors=[...])`, so that errors raised by later
    interceptors' handlers (auth) are mapped too. Handlers are wrapped per call, not cached per
    method: a later interceptor may return a different handler for each call (a deny handler for
    one caller), and wrapping costs a few microseconds per RPC, not per message.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        return _wrap(handler, handler_call_details.method)


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary_response(handler.unary_unary, method), **codec
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _wrap_unary_response(handler.stream_unary, method), **codec
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _wrap_stream_response(handler.unary_stream, method), **codec
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream_response(handler.stream_stream, method), **codec
        )
    return handler
