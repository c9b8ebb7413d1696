"""TLS credentials of a gRPC client of the daemon (`kvsched status`, `kvsched replay`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsched.core.errors import ConfigError


def channel_credentials(ca: str, cert: str, key: str) -> Any:
    """TLS credentials for a client of the daemon from `--tls-ca`, `--tls-cert`, `--tls-key`
    (file paths, "" when not given), or None for plaintext. A client certificate (mutual TLS)
    implies TLS; without --tls-ca the daemon is verified against the system's CAs.
    ConfigError for a missing file or a certificate without its key."""
    if bool(cert) != bool(key):
        raise ConfigError("--tls-cert and --tls-key go together (mutual TLS needs both)")
    if not (ca or cert):
        return None
    import grpc  # only a TLS client pays for it here

    def read(flag: str, path: str) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{flag} {path!r}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        read("--tls-ca", ca), read("--tls-key", key), read("--tls-cert", cert)
    )
