"""Reading the daemon's configuration: TOML file, KVSCHED_* environment, command-line flags
(later wins), merged into one validated `ServerConfig` (kvsched/server/config/settings.py says what each
source may set and how values are parsed)."""

from __future__ import annotations

import copy
import difflib
import logging
import math
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from enum import Enum
from typing import Any

from kvsched.core.config import EngineConfig
from kvsched.core.errors import ConfigError
from kvsched.server.config.settings import (
    _ENGINE_SECTIONS,
    _SCALARS,
    ENV_PREFIX,
    FieldError,
    InstanceConfig,
    ServerConfig,
    _prefixed,
    _unknown,
)

__all__ = ["load_config"]

log = logging.getLogger("kvsched.config")

# KVSCHED_* names that are not daemon settings (workers, clients and tools share the prefix).
OTHER_ENV = frozenset(
    {"CONFIG", "TOKEN", "TRACE_DIR", "BENCH_PROFILE_DAEMON", "TAKEOVER_JSON", "EVENT_LOOP"}
)
# The vLLM worker's own variables (KVSCHED_VLLM_COMPILE, _NAP_US, _SPIN_BATCH: worker_vllm/):
# one shell often starts the daemon and the worker, so the daemon does not warn about them.
WORKER_ENV_PREFIX = "vllm_"


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_text(label: str, text: str, kind: type) -> Any:
    """A string from the environment or a flag, converted to `kind`."""
    value = text.strip()
    if kind is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ConfigError(f"{label}: {text!r} is not a boolean (1/0/true/false/yes/no)")
    if kind is int:
        try:
            return int(value, 10)
        except ValueError:
            raise ConfigError(f"{label}: {text!r} is not an integer") from None
    if kind is float:
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{label}: {text!r} is not a number") from None
        if not math.isfinite(number):
            raise ConfigError(f"{label}: {text!r} is not a finite number")
        return number
    return text


def _check_type(label: str, value: Any, kind: type) -> Any:
    """A value from TOML or a flag, checked against `kind` (an int is a fine float)."""
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(
            f"{label} = {value!r} has type {type(value).__name__}; expected {kind.__name__}"
        )
    return value


def _engine_kind(path: list[str]) -> type | None:
    """The type of engine field `path` (e.g. ['scheduler', 'max_num_seqs']), None if unknown."""
    if path == ["role"]:
        return str
    if len(path) != 2 or path[0] not in _ENGINE_SECTIONS:
        return None
    section = getattr(EngineConfig(), path[0])
    if path[1] not in {f.name for f in fields(section)}:
        return None
    default = getattr(section, path[1])
    return str if isinstance(default, Enum) else type(default)


def _set_path(table: dict[str, Any], path: list[str], value: Any, label: str) -> None:
    for key in path[:-1]:
        table = table.setdefault(key, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{label}: engine.{key} is not a table")
    table[path[-1]] = value


def _unknown_in_engine(table: Any, where: str) -> list[str]:
    """The unknown keys of an engine table (`[engine]` or an instance's sections)."""
    out: list[str] = []
    if not isinstance(table, dict):
        return out
    for key, value in table.items():
        if key in ("role", "world_size"):
            continue
        if key not in _ENGINE_SECTIONS:
            close = difflib.get_close_matches(key, ["role", *_ENGINE_SECTIONS], n=1)
            out.append(f"{where}{key}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        if not isinstance(value, dict):
            continue  # a type error, reported when the section is read
        for name in value:
            if _engine_kind([key, name]) is None:
                known = [f.name for f in fields(getattr(EngineConfig(), key))]
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                out.append(f"{where}{key}.{name}{hint}")
    return out


def _unknown_toml_keys(data: dict[str, Any]) -> list[str]:
    """Every unknown key of a config file, with a close known name where there is one."""
    out: list[str] = []
    for key in data:
        if key not in _SCALARS and key not in ("engine", "instances"):
            close = difflib.get_close_matches(key, list(_SCALARS), n=1)
            out.append(repr(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
    out += _unknown_in_engine(data.get("engine"), "engine.")
    instances = data.get("instances")
    if isinstance(instances, dict):
        for iid, table in instances.items():
            out += _unknown_in_engine(table, f"instances.{iid}.")
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class _Layers:
    """The raw values of every source, merged in order, and where each top-level value came from."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.engine: dict[str, Any] = {}
        self.instances: dict[str, Any] = {}

    def set_scalar(self, name: str, value: Any, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def read_toml(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r}: no such file") from None
        except OSError as exc:
            raise ConfigError(f"config file {path!r}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path!r}: invalid TOML: {exc}") from None
        unknown = _unknown_toml_keys(data)
        if unknown:
            raise ConfigError(
                f"config file {path!r}: {len(unknown)} unknown key(s): " + "; ".join(unknown)
            )
        for key, value in data.items():
            if key in ("engine", "instances"):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key} in {path!r} must be a table ([{key}])")
                setattr(self, key, value)
            elif key in _SCALARS:
                self.set_scalar(key, _check_type(key, value, _SCALARS[key]), path)
            else:
                raise _unknown(key, f"{path}: ", [*_SCALARS, "engine", "instances"])

    def read_env(self, env: Mapping[str, str]) -> None:
        for name, text in env.items():
            if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
                continue
            rest = name[len(ENV_PREFIX) :].lower()
            if rest.startswith("engine__"):
                self.set_engine(rest.split("__")[1:], text, name)
            elif rest in _SCALARS:
                self.set_scalar(rest, _parse_text(name, text, _SCALARS[rest]), name)
            elif rest.upper() not in OTHER_ENV and not rest.startswith(WORKER_ENV_PREFIX):
                close = difflib.get_close_matches(rest, list(_SCALARS), n=1)
                hint = f" (did you mean {ENV_PREFIX}{close[0].upper()}?)" if close else ""
                log.warning(
                    "ignoring unknown environment variable %s: no such setting%s", name, hint
                )

    def set_engine(self, path: list[str], value: Any, label: str) -> None:
        kind = _engine_kind(path)
        dotted = "engine." + ".".join(path)
        if kind is None:
            raise ConfigError(
                f"{label}: unknown field {dotted}; expected engine.role or "
                f"engine.<{'|'.join(_ENGINE_SECTIONS)}>.<field> (see examples/kvsched.toml)"
            )
        parsed = (
            _parse_text(label, value, kind)
            if isinstance(value, str)
            else _check_type(label, value, kind)
        )
        _set_path(self.engine, path, parsed, label)

    def read_overrides(self, overrides: Mapping[str, Any]) -> None:
        for key, value in overrides.items():
            if value is None:
                continue
            label = "--" + key.replace("_", "-")
            if key.startswith("engine."):
                self.set_engine(key.split(".")[1:], value, label)
            elif key in _SCALARS:
                kind = _SCALARS[key]
                parsed = (
                    _parse_text(label, value, kind)
                    if isinstance(value, str)
                    else _check_type(label, value, kind)
                )
                self.set_scalar(key, parsed, label)
            else:
                raise _unknown(key, "override: ", list(_SCALARS))

    def build(self) -> ServerConfig:
        engine = _prefixed("[engine]", lambda: EngineConfig.from_dict(copy.deepcopy(self.engine)))
        instances = {iid: self._instance(iid, table) for iid, table in self.instances.items()}
        config = ServerConfig(**self.values, engine=engine, instances=instances)
        try:
            return config.validate()
        except FieldError as exc:
            source = self.sources.get(exc.field_name)
            if source is None:
                raise
            raise FieldError(exc.field_name, f"{exc} (from {source})") from None

    def _instance(self, instance_id: str, table: Any) -> InstanceConfig:
        where = f"[instances.{instance_id}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table, not {table!r}")
        known = ["role", "world_size", *_ENGINE_SECTIONS]
        for key in table:
            if key not in known:
                raise _unknown(key, f"{where} ", known)
        world_size = _check_type(f"{where} world_size", table.get("world_size", 1), int)
        overrides = {k: v for k, v in table.items() if k != "world_size"}
        merged = _merge(self.engine, overrides)
        engine = _prefixed(where, lambda: EngineConfig.from_dict(merged))
        return InstanceConfig(role=engine.role, world_size=world_size, engine=engine).validate(
            instance_id
        )


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """The validated configuration from a TOML file, then `env`, then `overrides` (later wins).

    `path` None falls back to `env["KVSCHED_CONFIG"]`, then to no file. `env` None means no
    environment (pass `os.environ` explicitly). Raises `ConfigError` naming the field.
    """
    env = {} if env is None else env
    layers = _Layers()
    path = path or env.get(ENV_PREFIX + "CONFIG") or None
    if path is not None:
        layers.read_toml(path)
    layers.read_env(env)
    layers.read_overrides(overrides or {})
    return layers.build()
