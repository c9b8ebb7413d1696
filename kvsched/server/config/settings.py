"""The daemon's configuration: one typed, validated object, from file, environment and flags.

Sources, later wins:

    TOML file (--config, or KVSCHED_CONFIG)  ->  KVSCHED_* environment  ->  command-line flags

- TOML: top-level scalars (`listen = ...`), `[engine]` (`role`, `[engine.cache]`,
  `[engine.scheduler]`, `[engine.speculative]`, `[engine.step_cost]`, `[engine.fairness]`
  (with `[engine.fairness.tenant_weights]`): the default engine of
  every instance) and
  `[instances.<id>]` tables (`role`, `world_size`, and engine sections merged over the default
  engine). `examples/kvsched.toml` documents every field with its default.
- Environment: `KVSCHED_<FIELD>` for each top-level scalar (`KVSCHED_LISTEN`), and
  `KVSCHED_ENGINE__<SECTION>__<FIELD>` for the default engine
  (`KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQS=64`, `KVSCHED_ENGINE__ROLE=prefill`). Values are parsed
  by the field's type; booleans accept 1/0/true/false/yes/no/on/off. Other `KVSCHED_*` names are
  ignored with a warning (a misspelled setting), except those of workers and tools that share
  the prefix (`config_load.OTHER_ENV`: KVSCHED_TOKEN, KVSCHED_TRACE_DIR, ...).
- Flags: `overrides` maps a field name (or `engine.<section>.<field>`) to its value; None means
  the flag was not given.

An instance table overrides the default engine, whatever source set the default: the more
specific setting wins. Every error is a `ConfigError` whose message names the field, the allowed
range and, for `load_config` (kvsched/server/config/load.py), where the value came from.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from kvsched.core.config import EngineConfig, PdTransfer, Role
from kvsched.core.errors import ConfigError
from kvsched.core.router import OVERLOAD_POLICIES

__all__ = [
    "ConfigError",
    "InstanceConfig",
    "ServerConfig",
    "split_host_port",
]

ENV_PREFIX = "KVSCHED_"
MAX_WORLD_SIZE = 64
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TRACING_EXPORTERS = ("none", "console", "otlp")
CLUSTER_FALLBACKS = ("fail", "standalone")
_INT32_MAX = (1 << 31) - 1
_ENGINE_SECTIONS = ("cache", "scheduler", "speculative", "step_cost", "fairness")


class FieldError(ConfigError):
    """A `ConfigError` about one top-level field, so that `load_config` can say where it came from."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name


@dataclass(slots=True)
class InstanceConfig:
    """One model instance: its role, its tensor-parallel width and its engine.

    `role` is authoritative; `validate()` copies it into `engine.role`.
    """

    role: Role = Role.MIXED
    world_size: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)

    def validate(self, instance_id: str) -> InstanceConfig:
        where = f"[instances.{instance_id}]"
        if not instance_id:
            raise ConfigError("[instances] an instance id must not be empty")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ConfigError(
                f"{where} world_size = {self.world_size!r} is out of range [1, {MAX_WORLD_SIZE}]"
            )
        self.engine.role = self.role
        _prefixed(where, self.engine.validate)
        self.role = self.engine.role
        return self


@dataclass(slots=True)
class ServerConfig:
    """Everything `kvsched serve` needs. Build it with `load_config`, or directly and `validate()`."""

    listen: str = "127.0.0.1:50051"  # HOST:PORT or unix:PATH; port 0 picks a free port
    metrics_listen: str = "127.0.0.1:9464"  # HOST:PORT; "" or "off" disables (normalized to "")
    # Largest gRPC message the daemon receives (0: derived from max_model_len, see
    # `receive_message_bytes`); messages it sends may be up to max(this, 64 MiB).
    max_message_bytes: int = 0
    max_concurrent_streams: int = 10000
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    grace_period_s: float = 30.0  # SIGTERM: let running requests finish this long, then abort
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    # A worker leaves a daemon that sent it nothing for this many heartbeat intervals
    # (Welcome.silence_timeout_ns): a paused or hung daemon does not hold its workers.
    silence_timeout_intervals: float = 5.0
    requeue_timeout_s: float = 30.0  # a lost instance's request waits this long for another
    forget_lost_instance_s: float = 300.0  # an auto-created instance without workers is dropped
    poison_max_losses: int = (
        2  # a request on this many lost instances ends (server/requests/poison.py)
    )
    max_session_requests: int = 100000  # open requests per Session stream
    default_max_tokens: int = 16  # a request that does not set max_tokens gets this many
    stall_timeout_s: float = 30.0  # a stream that does not read its outputs this long is cut
    queue_timeout_s: float = 0.0  # a request never scheduled within this ends (0: no limit)
    # Routing at overload (core/router.py): a request without a deadline of its own is placed
    # only where its predicted wait meets this; one no instance can serve in time is "demote"d
    # (queued behind those that can), "refuse"d (RESOURCE_EXHAUSTED with a retry hint) or
    # placed by score alone ("off").
    routing_ttft_target_ms: float = 5000.0
    routing_overload: str = "demote"
    engine: EngineConfig = field(default_factory=EngineConfig)
    instances: dict[str, InstanceConfig] = field(default_factory=dict)
    auto_instances: bool = True  # a Hello with an unknown instance id creates it from `engine`
    model: str = "default"
    log_level: str = "info"
    log_json: bool = False
    tracing_exporter: str = "none"
    otlp_endpoint: str = ""
    otlp_headers: str = ""
    service_name: str = "kvsched"
    auth_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    cluster: str = ""  # NATS URL (nats://HOST:PORT) of the cluster; "": a standalone daemon
    daemon_id: str = ""  # this daemon's id in the cluster; "": derived from the listen address
    advertise: str = ""  # HOST:PORT peers and workers reach this daemon at; "": the listen address
    cluster_fallback: str = "fail"  # NATS unreachable at start: "fail", or run "standalone"
    cluster_token: str = ""  # bearer token (role client) this daemon sends to peers it forwards to
    member_ttl_s: float = 6.0  # a daemon whose membership entry is this old is presumed dead
    journal: bool = True  # with `cluster`: journal accepted requests in JetStream (durability)
    take_over: str = ""  # at start, also take over this (dead) daemon's unfinished requests
    journal_flush_ms: float = 100.0  # output tokens are journaled at most this often
    journal_timeout_s: float = 2.0  # an accepted record not stored within this: UNAVAILABLE
    journal_max_age_s: float = 86400.0  # finished requests' records age out after this
    journal_max_bytes: int = 1 << 30  # the journal stream's size cap (oldest dropped beyond)
    # The shared storage KV tier (docs/STORAGE.md): "" none; "mooncake" a Mooncake Store at its
    # master's default address (mooncake://127.0.0.1:50051); "mooncake://HOST:PORT[?metadata=
    # HOST:PORT]" the store whose master is there. Workers that list the kind in
    # Hello.storage_backends are told the URL (Welcome.storage_url) and get storage tasks.
    storage: str = ""
    # The model's tokenizer directory, for a gateway in front (docs/GATEWAY.md): announced in
    # the engine protocol's GetModelInfo and sent zipped by its GetTokenizer. "": none.
    tokenizer: str = ""

    def validate(self) -> ServerConfig:
        """Check every field; normalize `log_level`, `tracing_exporter`, `metrics_listen`."""
        _check_address("listen", self.listen, allow_unix=True)
        if self.metrics_listen.strip().lower() in ("", "off"):
            self.metrics_listen = ""
        else:
            _check_address("metrics_listen", self.metrics_listen, allow_unix=False)
        for name, (lo, hi) in _RANGES.items():
            _check_range(name, getattr(self, name), lo, hi)
        if 0 < self.max_message_bytes < 1024:
            raise FieldError(
                "max_message_bytes",
                f"max_message_bytes = {self.max_message_bytes} is below 1024 (0: derived from "
                "max_model_len)",
            )
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise FieldError(
                "heartbeat_timeout_s",
                f"heartbeat_timeout_s = {self.heartbeat_timeout_s!r} must be greater than "
                f"heartbeat_interval_s = {self.heartbeat_interval_s!r}",
            )
        self.log_level = _choice("log_level", self.log_level, LOG_LEVELS, {"warn": "warning"})
        self.tracing_exporter = _choice(
            "tracing_exporter", self.tracing_exporter, TRACING_EXPORTERS
        )
        self._validate_cluster()
        self.storage = storage_url(self.storage)
        for name in ("model", "service_name"):
            if not getattr(self, name).strip():
                raise FieldError(name, f"{name} must not be empty")
        self._validate_files()
        _prefixed("[engine]", self.engine.validate)
        for instance_id, instance in self.instances.items():
            instance.validate(instance_id)
            if (
                instance.role == Role.PREFILL
                and not self.storage
                and (instance.engine.cache.pd_transfer == PdTransfer.STORAGE)
            ):
                raise ConfigError(
                    f'[instances.{instance_id}] cache.pd_transfer = "storage" needs the '
                    'storage tier: set `storage` (e.g. "mooncake"), or pd_transfer = "push"'
                )
        return self

    def _validate_cluster(self) -> None:
        self.routing_overload = _choice(
            "routing_overload", self.routing_overload, OVERLOAD_POLICIES
        )
        self.cluster_fallback = _choice(
            "cluster_fallback", self.cluster_fallback, CLUSTER_FALLBACKS
        )
        if self.cluster and not self.cluster.startswith(("nats://", "tls://")):
            raise FieldError(
                "cluster", f"cluster = {self.cluster!r}: expected a NATS URL like nats://HOST:PORT"
            )
        if self.advertise:
            _check_address("advertise", self.advertise, allow_unix=False)
        if self.daemon_id and not all(c.isalnum() or c in "-_" for c in self.daemon_id):
            raise FieldError(
                "daemon_id", f"daemon_id = {self.daemon_id!r}: use letters, digits, '-' and '_'"
            )
        t = self.take_over
        if t and (t == self.daemon_id or not (self.cluster and self.journal) or not _id_ok(t)):
            raise FieldError("take_over", f"take_over = {t!r}: not a peer's id, or no journal")

    def _validate_files(self) -> None:
        if self.tokenizer and not os.path.isdir(self.tokenizer):
            raise FieldError("tokenizer", f"tokenizer = {self.tokenizer!r} is not a directory")
        if bool(self.tls_cert) != bool(self.tls_key):
            given, missing = ("tls_cert", "tls_key") if self.tls_cert else ("tls_key", "tls_cert")
            raise FieldError(missing, f"{given} is set but {missing} is not; TLS needs both")
        if self.tls_client_ca and not self.tls_cert:
            raise FieldError(
                "tls_client_ca", "tls_client_ca (client certificates) needs tls_cert and tls_key"
            )
        for name in ("auth_file", "tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise FieldError(name, f"{name} = {path!r}: no such file")

    def receive_message_bytes(self) -> int:
        """The largest message the daemon takes in: max_message_bytes when set, else the
        largest valid request (max_model_len token ids, 5 bytes each at most, packed) plus
        1 MiB for its other fields: a request that cannot be valid is refused by gRPC before
        the daemon holds it (a 60 MB prompt costs nothing but its refusal)."""
        if self.max_message_bytes:
            return self.max_message_bytes
        mml = max(
            [self.engine.scheduler.max_model_len]
            + [i.engine.scheduler.max_model_len for i in self.instances.values()]
        )
        return min(_INT32_MAX, 6 * mml + (1 << 20))

    def send_message_bytes(self) -> int:
        """The largest message the daemon sends (a Session's batch of many requests' tokens
        may exceed the largest request)."""
        return max(self.max_message_bytes, 64 << 20)

    def instance_for(self, instance_id: str, world_size: int = 1) -> InstanceConfig | None:
        """The configuration of an instance a worker names in Hello.

        A configured instance as given; otherwise, with `auto_instances`, a fresh one with a copy
        of the default engine and `world_size` from the Hello; otherwise None (refuse it).
        """
        configured = self.instances.get(instance_id)
        if configured is not None or not self.auto_instances:
            return configured
        engine = copy.deepcopy(self.engine)
        return InstanceConfig(role=engine.role, world_size=world_size, engine=engine)


_RANGES: dict[str, tuple[float, float]] = {
    "max_message_bytes": (0, _INT32_MAX),
    "max_concurrent_streams": (1, _INT32_MAX),
    "keepalive_time_s": (0.01, 86400.0),
    "keepalive_timeout_s": (0.01, 3600.0),
    "grace_period_s": (0.0, 86400.0),
    "heartbeat_interval_s": (0.01, 3600.0),
    "heartbeat_timeout_s": (0.01, 86400.0),
    "silence_timeout_intervals": (2.0, 1000.0),
    "requeue_timeout_s": (0.0, 86400.0),
    "poison_max_losses": (1, 1000),
    "forget_lost_instance_s": (0.0, 1e9),
    "member_ttl_s": (0.5, 3600.0),
    "max_session_requests": (1, _INT32_MAX),
    "default_max_tokens": (1, _INT32_MAX),
    "stall_timeout_s": (0.1, 86400.0),
    "queue_timeout_s": (0.0, 86400.0),
    "routing_ttft_target_ms": (1.0, 3.6e9),
    "journal_flush_ms": (1.0, 60000.0),
    "journal_timeout_s": (0.01, 600.0),
    "journal_max_age_s": (1.0, 365 * 86400.0),
    "journal_max_bytes": (1 << 20, 1 << 50),
}

# Top-level fields set by a scalar: name -> type (from the defaults, so the two cannot disagree).
_SCALARS: dict[str, type] = {
    f.name: type(getattr(ServerConfig(), f.name))
    for f in fields(ServerConfig)
    if f.name not in ("engine", "instances")
}


# --- validation helpers ---------------------------------------------------------------------


def split_host_port(value: str) -> tuple[str, int]:
    """('host', port) of 'host:port' or '[v6addr]:port'; `ValueError` if it is neither."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(value)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(value)  # a bare IPv6 address is ambiguous: needs brackets
    port = int(port_text)
    if not host or port > 65535:
        raise ValueError(value)
    return host, port


def _check_address(name: str, value: str, allow_unix: bool) -> None:
    if allow_unix and value.startswith("unix:") and len(value) > len("unix:"):
        return
    try:
        split_host_port(value)
    except ValueError:
        forms = "HOST:PORT or unix:PATH" if allow_unix else "HOST:PORT"
        raise FieldError(
            name, f"{name} = {value!r} must be {forms} (port 0-65535; IPv6 as [ADDR]:PORT)"
        ) from None


def _id_ok(value: str) -> bool:  # a daemon id: letters, digits, '-', '_'
    return all(c.isalnum() or c in "-_" for c in value)


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise FieldError(name, f"{name} = {value!r} is out of range [{_num(lo)}, {_num(hi)}]")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _choice(
    name: str, value: str, allowed: tuple[str, ...], aliases: dict[str, str] | None = None
) -> str:
    norm = value.strip().lower()
    norm = (aliases or {}).get(norm, norm)
    if norm not in allowed:
        raise FieldError(name, f"{name} = {value!r}; expected one of {list(allowed)}")
    return norm


def _prefixed(where: str, validate: Any) -> Any:
    """Run an engine validation, putting `where` in front of any error it raises."""
    try:
        return validate()
    except ConfigError as exc:
        raise ConfigError(f"{where} {exc}") from None


def _unknown(key: str, where: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}unknown key {key!r}{hint} (known: {', '.join(sorted(known))})")


# --- parsing ----------------------------------------------------------------------------------


STORAGE_KINDS = ("mooncake",)
MOONCAKE_DEFAULT_MASTER = "127.0.0.1:50051"  # mooncake_master's default RPC port


def storage_url(value: str) -> str:
    """The `storage` setting as the URL a Welcome names ("" for none); FieldError otherwise."""
    value = value.strip()
    if not value:
        return ""
    if value in STORAGE_KINDS:
        return f"{value}://{MOONCAKE_DEFAULT_MASTER}"
    kind, sep, rest = value.partition("://")
    address = rest.split("?", 1)[0]
    host, colon, port = address.rpartition(":")
    if not sep or kind not in STORAGE_KINDS or not colon or not host or not port.isdigit():
        raise FieldError(
            "storage",
            f'storage = {value!r}: expected "" (none), "mooncake" or '
            "mooncake://HOST:PORT (a Mooncake master; `kvsched mooncake` starts one)",
        )
    if not 0 < int(port) < 65536:
        raise FieldError("storage", f"storage = {value!r}: port {port} is out of range")
    return value


def storage_kind(url: str) -> str:
    """The backend kind of a storage URL ("" for none): what Hello.storage_backends lists."""
    return url.partition("://")[0] if url else ""
