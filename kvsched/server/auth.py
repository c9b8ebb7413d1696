"""Bearer-token access control: one interceptor for unary and streaming RPCs alike.

    RequestService -> role `client`     WorkerService -> role `worker`
    AdminService   -> role `admin`      grpc.health.v1 and reflection -> no token needed

Tokens come from an auth file, one `ROLE TOKEN` pair a line (`#` starts a comment); a token on
several lines has each of their roles. Callers send `authorization: Bearer TOKEN` metadata (the
scheme is case-insensitive, RFC 7235). A missing or unknown token is UNAUTHENTICATED; a known
token without the service's role is PERMISSION_DENIED. A service this table does not name needs
the admin role: a service added later is closed until someone decides who may call it. Tokens are
compared in constant time, their length included (digests are compared). The caller's principal
(a digest of its token, never the token) is available to handlers through `current_principal`,
so a client can abort only the requests it submitted.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from kvsched.core import ConfigError

ROLES = ("client", "worker", "admin")
SERVICE_ROLES = {
    "kvsched.v1.RequestService": "client",
    "kvsched.v1.WorkerService": "worker",
    "kvsched.v1.AdminService": "admin",
    # The engine protocol a gateway speaks (server/gateway/): its requests are a client's.
    "vllm.grpc.engine.VllmEngine": "client",
}
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

current_principal: contextvars.ContextVar[str] = contextvars.ContextVar(
    "kvsched_principal", default=""
)


def principal_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def load_auth_file(path: str) -> list[tuple[str, str]]:
    """(role, token) pairs; ConfigError naming the file and line for anything malformed."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"auth_file {path!r}: {exc.strerror}") from None
    pairs: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in ROLES:
            raise ConfigError(
                f"auth_file {path}:{n}: expected `ROLE TOKEN` with ROLE one of {ROLES}"
            )
        if len(parts[1]) < 16:
            raise ConfigError(f"auth_file {path}:{n}: token shorter than 16 characters")
        pairs.append((parts[0], parts[1]))
    if not pairs:
        raise ConfigError(f"auth_file {path}: no `ROLE TOKEN` lines")
    return pairs


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        roles: dict[bytes, set[str]] = {}
        for role, token in pairs:
            roles.setdefault(_digest(token), set()).add(role)
        self._tokens = list(roles.items())

    def _roles_of(self, token: str) -> set[str]:
        """The roles of `token` (empty if unknown), comparing its digest against every known
        token's in constant time: equal lengths, so not even the length leaks."""
        given = _digest(token)
        found: set[str] = set()
        for known, roles in self._tokens:
            if hmac.compare_digest(given, known):
                found = roles
        return found

    def check(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | str:
        """The principal for a permitted call, else (status code, message)."""
        if method.startswith(EXEMPT_PREFIXES):
            return ""  # health, reflection: open
        service = method.lstrip("/").split("/", 1)[0]
        need = SERVICE_ROLES.get(service, "admin")
        auth = ""
        for key, value in metadata or ():
            if key == "authorization":
                auth = value if isinstance(value, str) else value.decode()
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() != "bearer":
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "missing credentials: send `authorization: Bearer <token>` metadata",
            )
        token = token.strip()
        roles = self._roles_of(token)
        if not roles:
            return grpc.StatusCode.UNAUTHENTICATED, "invalid token"
        if need not in roles:
            have = " / ".join(repr(r) for r in sorted(roles))
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"a {have} token may not call {service}; it needs a {need!r} token",
            )
        return principal_of(token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler  # unknown method (UNIMPLEMENTED), or open to all
        verdict = self.check(details.method, details.invocation_metadata)
        if isinstance(verdict, tuple):
            return _deny(handler, *verdict)
        return _with_principal(handler, verdict)


def _shape(handler: grpc.RpcMethodHandler) -> tuple[str, Any]:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        fn = getattr(handler, kind)
        if fn is not None:
            return kind, fn
    raise ValueError("empty handler")


def _rebuild(handler: grpc.RpcMethodHandler, kind: str, fn: Any) -> grpc.RpcMethodHandler:
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        fn,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    kind, _ = _shape(handler)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator)

    return _rebuild(handler, kind, stream if kind.endswith("_stream") else unary)


def _with_principal(handler: grpc.RpcMethodHandler, principal: str) -> Any:
    kind, fn = _shape(handler)
    if kind.endswith("_stream"):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # A streaming handler is an async generator, or a coroutine that calls
            # context.write() (grpc_health's Watch is one), or returns a plain iterable.
            current_principal.set(principal)
            result = fn(request, context)
            try:
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                elif inspect.isawaitable(result):
                    await result
                else:
                    for item in result or ():
                        yield item
            finally:
                if inspect.isasyncgen(result):
                    await result.aclose()

        return _rebuild(handler, kind, stream)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        current_principal.set(principal)
        result = fn(request, context)
        return await result if inspect.isawaitable(result) else result

    return _rebuild(handler, kind, unary)
