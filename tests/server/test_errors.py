"""ErrorInterceptor over a real grpc.aio server on loopback: each typed error arrives with its
status code and message, from unary and streaming handlers, also after a stream sent messages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest

from kvsched.core.errors import (
    CapacityExceeded,
    ConfigError,
    InvalidRequest,
    ProtocolError,
    RequestNotFound,
    Unavailable,
)
from kvsched.server.errors import (
    ERROR_TYPE_KEY,
    ErrorInterceptor,
    PermissionDenied,
    Unauthenticated,
    status_for,
)

SECRET = "db password is hunter2"

CASES: dict[str, tuple[Exception, grpc.StatusCode, str]] = {
    "invalid": (
        InvalidRequest("prompt is empty"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt is empty",
    ),
    "notfound": (RequestNotFound("no request 'r9'"), grpc.StatusCode.NOT_FOUND, "no request 'r9'"),
    "capacity": (
        CapacityExceeded("queue full (65536)"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "queue full (65536)",
    ),
    "protocol": (
        ProtocolError("unknown slot 7"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "unknown slot 7",
    ),
    "unavailable": (Unavailable("draining"), grpc.StatusCode.UNAVAILABLE, "draining"),
    "config": (
        ConfigError("x = 1 out of range"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "x = 1 out of range",
    ),
    "denied": (PermissionDenied("admin only"), grpc.StatusCode.PERMISSION_DENIED, "admin only"),
    "unauth": (Unauthenticated("missing token"), grpc.StatusCode.UNAUTHENTICATED, "missing token"),
    "empty": (Unavailable(), grpc.StatusCode.UNAVAILABLE, "unavailable; retry later"),
    "bug": (RuntimeError(SECRET), grpc.StatusCode.INTERNAL, "internal error (ref "),
}


def _identity(b: bytes) -> bytes:
    return b


def _error_for(request: bytes) -> Exception:
    return CASES[request.decode()][0]


async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    if request == b"ok":
        return b"fine"
    raise _error_for(request)


async def stream(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    yield b"first"
    if request != b"ok":
        raise _error_for(request)
    yield b"second"


async def stream_before_yield(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    raise _error_for(request)
    yield b"never"  # an async generator


async def stream_with_write(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.write(b"first")
    raise _error_for(request)


async def bidi(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    async for request in requests:
        if request != b"ok":
            raise _error_for(request)
        yield b"echo"


CLOSED: dict[str, asyncio.Event] = {}


async def endless(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    try:
        yield b"tick"
        await asyncio.Event().wait()  # until cancelled
        yield b"never"
    finally:
        CLOSED[request.decode()].set()


async def aborts_itself(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    await context.abort(grpc.StatusCode.ALREADY_EXISTS, "handler's own abort")
    raise AssertionError("unreachable")


def _handlers() -> grpc.GenericRpcHandler:
    codec = {"request_deserializer": _identity, "response_serializer": _identity}
    return grpc.method_handlers_generic_handler(
        "test.Errors",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, **codec),
            "Stream": grpc.unary_stream_rpc_method_handler(stream, **codec),
            "StreamBeforeYield": grpc.unary_stream_rpc_method_handler(stream_before_yield, **codec),
            "StreamWithWrite": grpc.unary_stream_rpc_method_handler(stream_with_write, **codec),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi, **codec),
            "Endless": grpc.unary_stream_rpc_method_handler(endless, **codec),
            "AbortsItself": grpc.unary_unary_rpc_method_handler(aborts_itself, **codec),
        },
    )


Body = Callable[[grpc.aio.Channel], Awaitable[None]]


def run_with_server(body: Body) -> None:
    async def main() -> None:
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        server.add_generic_rpc_handlers((_handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.wait_for(body(channel), timeout=30)
        finally:
            await server.stop(grace=None)

    asyncio.run(main())


def _call(channel: grpc.aio.Channel, method: str, kind: str) -> Any:
    make = channel.unary_unary if kind == "unary" else channel.unary_stream
    return make(
        f"/test.Errors/{method}", request_serializer=_identity, response_deserializer=_identity
    )


def _check(error: grpc.aio.AioRpcError, case: str) -> None:
    exc, code, message = CASES[case]
    assert error.code() == code, (case, error.code(), error.details())
    details = error.details() or ""
    assert details.startswith(message) if code is grpc.StatusCode.INTERNAL else details == message
    assert SECRET not in details and "Traceback" not in details
    trailer = dict(error.trailing_metadata() or ())
    if code is grpc.StatusCode.INTERNAL:
        assert ERROR_TYPE_KEY not in trailer
    else:
        assert trailer[ERROR_TYPE_KEY] == type(exc).__name__


@pytest.mark.parametrize("case", sorted(CASES))
def test_unary_errors_map_to_status(case: str) -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(channel, "Unary", "unary")(case.encode())
        _check(info.value, case)
        assert await _call(channel, "Unary", "unary")(b"ok") == b"fine"  # still serving

    run_with_server(body)


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_error_after_first_message(case: str) -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        for method in ("Stream", "StreamWithWrite"):
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for message in _call(channel, method, "stream")(case.encode()):
                    received.append(message)
            assert received == [b"first"], method
            _check(info.value, case)

    run_with_server(body)


@pytest.mark.parametrize("case", ["capacity", "bug"])
def test_stream_error_before_any_message(case: str) -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in _call(channel, "StreamBeforeYield", "stream")(case.encode()):
                raise AssertionError("no message expected")
        _check(info.value, case)

    run_with_server(body)


def test_bidi_stream_error_after_echo() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        call = channel.stream_stream(
            "/test.Errors/Bidi", request_serializer=_identity, response_deserializer=_identity
        )()
        await call.write(b"ok")
        assert await call.read() == b"echo"
        await call.write(b"protocol")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        _check(info.value, "protocol")

    run_with_server(body)


def test_successful_stream_untouched() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        received = [m async for m in _call(channel, "Stream", "stream")(b"ok")]
        assert received == [b"first", b"second"]

    run_with_server(body)


def test_client_cancel_closes_the_handler_generator() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        closed = CLOSED["c1"] = asyncio.Event()
        call = _call(channel, "Endless", "stream")(b"c1")
        assert await call.read() == b"tick"
        call.cancel()
        await asyncio.wait_for(closed.wait(), timeout=10)

    run_with_server(body)


def test_handler_abort_passes_through() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(channel, "AbortsItself", "unary")(b"x")
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert info.value.details() == "handler's own abort"

    run_with_server(body)


def test_unknown_method_is_unimplemented() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/test.Errors/Nope")(b"x")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED

    run_with_server(body)


def test_internal_error_logs_traceback_with_reference(caplog: pytest.LogCaptureFixture) -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(channel, "Unary", "unary")(b"bug")
        details = info.value.details() or ""
        ref = details.split("ref ")[1].split(")")[0]
        record = next(r for r in caplog.records if getattr(r, "error_ref", None) == ref)
        assert record.levelno == logging.ERROR and "/test.Errors/Unary" in record.getMessage()
        assert record.exc_info is not None and SECRET in str(record.exc_info[1])

    with caplog.at_level(logging.ERROR, logger="kvsched.server.errors"):
        run_with_server(body)


def test_status_for_in_band() -> None:
    class SubclassedNotFound(RequestNotFound):
        pass

    assert status_for(CapacityExceeded("full")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert status_for(SubclassedNotFound("r1")) == (grpc.StatusCode.NOT_FOUND, "r1")
    assert status_for(RequestNotFound()) == (grpc.StatusCode.NOT_FOUND, "request not found")
    code, message = status_for(KeyError(SECRET), where="Session")
    assert code is grpc.StatusCode.INTERNAL and SECRET not in message
