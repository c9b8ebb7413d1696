"""TLS credentials, in one place for every process kvsched runs: the daemon's server side
(`kvsched serve`), its clients (`kvsched status`, `kvsched replay`) and the reference worker
(its Connect stream and its KV-transfer server). Paths come from flags or config; "" means not
given. Every unusable file is a ConfigError that names the flag or field and the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsched.core.errors import ConfigError


def _read(flag: str, path: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: {exc.strerror}") from None


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

    return grpc.ssl_channel_credentials(
        _read("--tls-ca", ca), _read("--tls-key", key), _read("--tls-cert", cert)
    )


def worker_server_credentials(cert: str, key: str) -> Any:
    """Credentials for a worker's own KV-transfer server from its `--tls-cert`/`--tls-key`
    (the same pair it presents to the daemon), or None when it runs without TLS."""
    if not (cert and key):
        return None
    import grpc

    return grpc.ssl_server_credentials([(_read("--tls-key", key), _read("--tls-cert", cert))])


def server_credentials(cert: str, key: str, client_ca: str = "") -> Any:
    """The daemon's TLS credentials from the configured PEM files (`tls_cert`, `tls_key`, and
    `tls_client_ca` to require client certificates), checked first with the ssl module: grpc
    reports a bad certificate, a key that does not match it, or a bad CA file only as "Failed
    to bind to address"."""
    import ssl

    import grpc

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"tls_cert = {cert!r} / tls_key = {key!r}: not a PEM "
            f"certificate and the private key that matches it ({exc})"
        ) from None
    ca = None
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls_client_ca = {client_ca!r}: not a PEM CA certificate ({exc})"
            ) from None
        ca = Path(client_ca).read_bytes()
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )
