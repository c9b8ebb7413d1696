"""What a sync and an async client share: the channel's credentials and options, the bearer
token, and the default deadline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsched.tls import channel_credentials

Metadata = tuple[tuple[str, str], ...]

# Session messages batch a whole engine step across many requests; gRPC's 4 MiB default is
# too small for a replay with thousands in flight.
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


class Connection:
    """Settings of one client. `tls_ca`/`tls_cert`/`tls_key` are PEM file paths ("" = not
    given; any of them means TLS, cert + key mutual TLS), or pass ready `credentials`.
    `timeout` is the default deadline of every call in seconds (None: no deadline)."""

    def __init__(
        self,
        address: str,
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        credentials: Any = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self.credentials = (
            credentials
            if credentials is not None
            else channel_credentials(tls_ca, tls_cert, tls_key)
        )
        self.timeout = timeout
        self.options = [*DEFAULT_OPTIONS, *options]
        self.auth: Metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def open_channel(self, grpc_module: Any) -> Any:
        """A channel to the daemon from `grpc` (blocking) or `grpc.aio`: both have the same
        secure_channel / insecure_channel calls."""
        if self.credentials is not None:
            return grpc_module.secure_channel(self.address, self.credentials, options=self.options)
        return grpc_module.insecure_channel(self.address, options=self.options)

    def metadata(self, extra: Sequence[tuple[str, str]] = ()) -> Metadata:
        """The call's metadata: the bearer token, then `extra` (e.g. a traceparent)."""
        return self.auth + tuple(extra)

    def deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout
