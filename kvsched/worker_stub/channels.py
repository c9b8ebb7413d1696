"""gRPC channel and server settings the worker shares between its daemon stream and its KV
pushes, and the address it advertises to peers."""

from __future__ import annotations

import socket

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The daemon must accept pings this often: grpc.http2.min_ping_interval_without_data_ms <= 20 s.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS[:2]


def open_channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def advertised_address(listen: str, port: int) -> str:
    """host:port peers can reach: a wildcard listen host advertises this machine's name."""
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
