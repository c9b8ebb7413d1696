"""ServerConfig: TOML, then KVSCHED_* environment, then flags; every error names its field."""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kvsched.core.config import EngineConfig, QueuePolicy, Role
from kvsched.core.errors import ConfigError
from kvsched.server.config.load import load_config
from kvsched.server.config.settings import InstanceConfig, ServerConfig, split_host_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvsched.toml"


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvsched.toml"
    path.write_text(text)
    return str(path)


def load(
    tmp_path: Path, toml: str = "", env: dict[str, str] | None = None, **flags: Any
) -> ServerConfig:
    path = write_toml(tmp_path, toml) if toml else None
    return load_config(path, env or {}, flags)


def error_of(
    tmp_path: Path, toml: str = "", env: dict[str, str] | None = None, **flags: Any
) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, toml, env, **flags)
    return str(info.value)


# --- sources and precedence ---------------------------------------------------------------------


def test_defaults_without_any_source() -> None:
    config = load_config(None, {}, {})
    assert config == ServerConfig().validate()
    assert config.listen == "127.0.0.1:50051"
    assert config.max_message_bytes == 0  # derived from max_model_len:
    assert config.receive_message_bytes() == 6 * 131072 + (1 << 20)
    assert config.send_message_bytes() == 64 << 20
    assert config.engine == EngineConfig()
    assert config.instances == {}


def test_toml_then_env_then_flags(tmp_path: Path) -> None:
    toml = 'listen = "0.0.0.0:1"\nmodel = "from-toml"\nlog_level = "debug"\ngrace_period_s = 5\n'
    env = {"KVSCHED_LISTEN": "0.0.0.0:2", "KVSCHED_MODEL": "from-env"}
    config = load(tmp_path, toml, env, listen="0.0.0.0:3", log_level=None)
    assert config.listen == "0.0.0.0:3"  # flag beats env beats TOML
    assert config.model == "from-env"  # env beats TOML
    assert config.log_level == "debug"  # a flag that is None was not given
    assert config.grace_period_s == 5.0 and isinstance(config.grace_period_s, float)


def test_env_values_parsed_by_field_type() -> None:
    env = {
        "KVSCHED_MAX_MESSAGE_BYTES": "1048576",
        "KVSCHED_HEARTBEAT_TIMEOUT_S": "7.5",
        "KVSCHED_LOG_JSON": "yes",
        "KVSCHED_AUTO_INSTANCES": "0",
        "KVSCHED_TRACING_EXPORTER": "OTLP",
        "KVSCHED_METRICS_LISTEN": "off",
        "KVSCHED_TRACE_DIR": "/elsewhere",  # another tool's variable: ignored
    }
    config = load_config(None, env, {})
    assert config.max_message_bytes == 1048576
    assert config.heartbeat_timeout_s == 7.5
    assert config.log_json is True
    assert config.auto_instances is False
    assert config.tracing_exporter == "otlp"
    assert config.metrics_listen == ""


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "on"])
def test_env_true_spellings(text: str) -> None:
    assert load_config(None, {"KVSCHED_LOG_JSON": text}, {}).log_json is True


def test_nested_engine_env_paths(tmp_path: Path) -> None:
    toml = "[engine.scheduler]\nmax_num_seqs = 8\nmax_waiting = 10\n"
    env = {
        "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQS": "64",
        "KVSCHED_ENGINE__SCHEDULER__POLICY": "priority",
        "KVSCHED_ENGINE__CACHE__ENABLE_PREFIX_CACHING": "false",
        "KVSCHED_ENGINE__CACHE__RESERVE_DECAY": "0.5",
        "KVSCHED_ENGINE__SPECULATIVE__NUM_SPECULATIVE_TOKENS": "3",
        "KVSCHED_ENGINE__ROLE": "decode",
    }
    engine = load(tmp_path, toml, env).engine
    assert engine.scheduler.max_num_seqs == 64  # env beats TOML
    assert engine.scheduler.max_waiting == 10  # TOML kept
    assert engine.scheduler.policy is QueuePolicy.PRIORITY
    assert engine.cache.enable_prefix_caching is False
    assert engine.cache.reserve_decay == 0.5
    assert engine.speculative.num_speculative_tokens == 3
    assert engine.role is Role.DECODE


def test_nested_engine_flag_override() -> None:
    config = load_config(None, {}, {"engine.scheduler.max_num_seqs": 4, "engine.role": None})
    assert config.engine.scheduler.max_num_seqs == 4


def test_config_path_from_env(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'model = "m"\n')
    assert load_config(None, {"KVSCHED_CONFIG": path}, {}).model == "m"


def test_instances_merge_over_default_engine(tmp_path: Path) -> None:
    toml = """
[engine]
role = "mixed"
[engine.scheduler]
max_num_seqs = 32
max_waiting = 100

[instances.p0]
role = "prefill"
world_size = 2
[instances.p0.scheduler]
max_num_seqs = 8

[instances.d0]
role = "decode"

[instances.m0]
"""
    env = {"KVSCHED_ENGINE__SCHEDULER__MAX_WAITING": "200"}
    config = load(tmp_path, toml, env)
    p0, d0, m0 = config.instances["p0"], config.instances["d0"], config.instances["m0"]
    assert (p0.role, p0.world_size, p0.engine.role) == (Role.PREFILL, 2, Role.PREFILL)
    assert p0.engine.scheduler.max_num_seqs == 8  # the instance's own setting wins
    assert p0.engine.scheduler.max_waiting == 200  # the default engine, env included
    assert (d0.role, d0.world_size) == (Role.DECODE, 1)
    assert d0.engine.scheduler.max_num_seqs == 32
    assert m0 == InstanceConfig(role=Role.MIXED, world_size=1, engine=config.engine)
    assert m0.engine is not config.engine


def test_instance_for_configured_auto_and_refused(tmp_path: Path) -> None:
    config = load(tmp_path, "[instances.a]\nworld_size = 2\n")
    assert config.instance_for("a") is config.instances["a"]
    auto = config.instance_for("new", world_size=4)
    assert auto is not None and auto.world_size == 4 and auto.engine == config.engine
    assert auto.engine is not config.engine  # a copy: the daemon may adjust it per instance
    config.auto_instances = False
    assert config.instance_for("new") is None


def test_example_file_documents_every_field_with_its_default() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    top = {f.name for f in fields(ServerConfig)} - {"engine", "instances"}
    assert top <= set(data), top - set(data)
    engine = EngineConfig()
    for section in ("cache", "scheduler", "speculative"):
        names = {f.name for f in fields(getattr(engine, section))}
        assert set(data["engine"][section]) == names, section
    assert load_config(str(EXAMPLE), {}, {}) == ServerConfig().validate()


def test_example_instances_block_loads(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    block = text[text.index("# [instances.prefill0]") :]
    uncommented = "\n".join(line.removeprefix("#").strip() for line in block.splitlines())
    config = load(tmp_path, uncommented)
    assert config.instances["prefill0"].world_size == 2
    assert config.instances["decode0"].engine.cache.prealloc_blocks == 4


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    for bad in ("nope", ":1", "host:", "host:99999", "::1:5", "h:p"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_addresses_accepted() -> None:
    config = load_config(None, {}, {"listen": "unix:/tmp/k.sock", "metrics_listen": "[::]:0"})
    assert config.listen == "unix:/tmp/k.sock"


# --- errors name the field ----------------------------------------------------------------------


def test_env_parse_errors_name_the_variable() -> None:
    cases = {
        "KVSCHED_HEARTBEAT_TIMEOUT_S": (
            "abc",
            "KVSCHED_HEARTBEAT_TIMEOUT_S: 'abc' is not a number",
        ),
        "KVSCHED_MAX_MESSAGE_BYTES": (
            "64MiB",
            "KVSCHED_MAX_MESSAGE_BYTES: '64MiB' is not an integer",
        ),
        "KVSCHED_LOG_JSON": ("maybe", "KVSCHED_LOG_JSON: 'maybe' is not a boolean"),
        "KVSCHED_GRACE_PERIOD_S": ("nan", "KVSCHED_GRACE_PERIOD_S: 'nan' is not a finite number"),
        "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQS": (
            "x",
            "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQS: 'x' is not an integer",
        ),
    }
    for name, (value, expected) in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(None, {name: value}, {})
        assert expected in str(info.value), (name, str(info.value))


def test_unknown_engine_env_path() -> None:
    with pytest.raises(
        ConfigError,
        match=r"KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQZ: unknown field engine\.scheduler\.max_num_seqz",
    ):
        load_config(None, {"KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQZ": "1"}, {})
    with pytest.raises(ConfigError, match="KVSCHED_ENGINE__VALIDATE"):
        load_config(None, {"KVSCHED_ENGINE__VALIDATE": "1"}, {})


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('listen = "nope"', "listen = 'nope' must be HOST:PORT"),
        ('metrics_listen = "1.2.3.4"', "metrics_listen = '1.2.3.4' must be HOST:PORT"),
        ("max_message_bytes = 5", "max_message_bytes = 5 is below 1024 (0: derived"),
        ("max_concurrent_streams = -1", "max_concurrent_streams = -1 is out of range"),
        ("keepalive_time_s = 0", "keepalive_time_s = 0.0 is out of range [0.01, 86400]"),
        ("grace_period_s = -1", "grace_period_s = -1.0 is out of range [0, 86400]"),
        ("stall_timeout_s = 0", "stall_timeout_s = 0.0 is out of range [0.1, 86400]"),
        ("max_session_requests = 0", "max_session_requests = 0 is out of range"),
        (
            "heartbeat_interval_s = 5\nheartbeat_timeout_s = 5",
            "heartbeat_timeout_s = 5.0 must be greater than heartbeat_interval_s = 5.0",
        ),
        (
            'tracing_exporter = "jaeger"',
            "tracing_exporter = 'jaeger'; expected one of ['none', 'console', 'otlp']",
        ),
        ('log_level = "loud"', "log_level = 'loud'; expected one of"),
        ('model = ""', "model must not be empty"),
        ('max_message_bytes = "64MiB"', "max_message_bytes = '64MiB' has type str; expected int"),
        ("log_json = 1", "log_json = 1 has type int; expected bool"),
        ("listn = 'x'", "unknown key(s): 'listn' (did you mean 'listen'?)"),
        ("[engine]\nrole = 'both'", "[engine] role = 'both'; expected one of"),
        (
            "[engine.scheduler]\nmax_num_seqs = 0",
            "[engine] scheduler.max_num_seqs = 0 is out of range",
        ),
        ("[engine.cache]\nblock_sise = 16", "engine.cache.block_sise (did you mean 'block_size'?)"),
        ("[engine.turbo]\nx = 1", "unknown key(s): engine.turbo"),
        ("[instances.a]\nworld_size = 0", "[instances.a] world_size = 0 is out of range [1, 64]"),
        ("[instances.a]\nworld_size = 65", "[instances.a] world_size = 65 is out of range [1, 64]"),
        ("[instances.a]\nrank = 1", "unknown key(s): instances.a.rank"),
        ("[instances.a]\nrole = 'x'", "[instances.a] role = 'x'; expected one of"),
        (
            "[instances.a.scheduler]\nmax_num_seqs = -2",
            "[instances.a] scheduler.max_num_seqs = -2 is out of range",
        ),
        ("instances = 3", "instances in"),
        ("[instances]\na = 3", "[instances.a] must be a table"),
    ],
)
def test_toml_errors_name_the_field(tmp_path: Path, toml: str, expected: str) -> None:
    message = error_of(tmp_path, toml + "\n")
    assert expected in message, message


def test_range_error_says_where_the_value_came_from(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "stall_timeout_s = 0\n")
    with pytest.raises(ConfigError, match=f"stall_timeout_s = 0.0 .*\\(from {path}\\)"):
        load_config(path, {}, {})
    with pytest.raises(ConfigError, match=r"\(from KVSCHED_LISTEN\)"):
        load_config(None, {"KVSCHED_LISTEN": "nope"}, {})
    with pytest.raises(ConfigError, match=r"listen = 'x' must be HOST:PORT.*\(from --listen\)"):
        load_config(None, {}, {"listen": "x"})


def test_tls_and_auth_files(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for p in (cert, key, ca):
        p.write_text("x")
    message = error_of(tmp_path, tls_cert=str(cert))
    assert "tls_cert is set but tls_key is not" in message
    assert "tls_key is set but tls_cert is not" in error_of(tmp_path, tls_key=str(key))
    assert "tls_client_ca" in error_of(tmp_path, tls_client_ca=str(ca))
    assert "auth_file = '/no/such': no such file" in error_of(tmp_path, auth_file="/no/such")
    config = load(tmp_path, tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ca))
    assert config.tls_client_ca == str(ca)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "missing.toml"), {}, {})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write_toml(tmp_path, "listen = \n"), {}, {})


def test_bad_override_key_and_type() -> None:
    with pytest.raises(ConfigError, match="unknown key 'lisen'"):
        load_config(None, {}, {"lisen": "x"})
    with pytest.raises(
        ConfigError, match=r"--max-session-requests = 2\.5 has type float; expected int"
    ):
        load_config(None, {}, {"max_session_requests": 2.5})


def test_validate_direct_construction() -> None:
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        ServerConfig(heartbeat_timeout_s=0.5).validate()
    config = ServerConfig(metrics_listen="OFF", log_level="WARN").validate()
    assert (config.metrics_listen, config.log_level) == ("", "warning")


def test_storage_takes_none_mooncake_or_a_master_url() -> None:
    from kvsched.server.config.load import load_config

    assert load_config(None, {}, {}).storage == ""
    assert load_config(None, {}, {"storage": "mooncake"}).storage.startswith("mooncake://")
    url = "mooncake://10.0.0.7:7000?metadata=10.0.0.7:8080"
    assert load_config(None, {"KVSCHED_STORAGE": url}, {}).storage == url
    for bad in ("redis://h:1", "mooncake://h", "mooncake://h:0", "files"):
        with pytest.raises(ConfigError, match="storage"):
            load_config(None, {}, {"storage": bad})
    cfg = load_config(None, {}, {"engine.cache.storage_write_policy": "write_through"})
    assert cfg.engine.cache.storage_write_policy == "write_through"
    with pytest.raises(ConfigError, match="storage_write_policy"):
        load_config(None, {}, {"engine.cache.storage_write_policy": "write_through_selective"})


def test_the_vllm_workers_variables_are_not_the_daemons(caplog: pytest.LogCaptureFixture) -> None:
    """One shell often starts the daemon and the vLLM worker: the worker's variables
    (KVSCHED_VLLM_*) draw no warning from the daemon; a misspelt daemon setting still does."""
    env = {"KVSCHED_VLLM_COMPILE": "0", "KVSCHED_VLLM_NAP_US": "50", "KVSCHED_LOG_JSN": "1"}
    with caplog.at_level("WARNING", logger="kvsched.server.config.load"):
        load_config(None, env, {})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "KVSCHED_LOG_JSN" in warned[0], warned
