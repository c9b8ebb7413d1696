"""format_status: a hand-built GetStatusResponse as a terminal table."""

from __future__ import annotations

from kvsched.server.status_view import format_status
from kvsched.v1 import admin_service_pb2, common_pb2


def make_response() -> admin_service_pb2.GetStatusResponse:
    return admin_service_pb2.GetStatusResponse(
        draining=False,
        paused=True,
        num_waiting=3,
        num_running=12,
        instances=[
            admin_service_pb2.InstanceStatus(
                instance_id="i0",
                role=common_pb2.INSTANCE_ROLE_MIXED,
                ready=True,
                paused=True,
                num_ranks_connected=2,
                world_size=2,
                model="m",
                num_slots_used=12,
                num_slots=256,
                num_gpu_blocks=4096,
                num_free_blocks=2560,
                kv_cache_usage=0.375,
                num_waiting=3,
                num_running=12,
                num_steps=1000,
                steps_per_s=41.26,
                prefix_cache_query_tokens=1000,
                prefix_cache_hit_tokens=620,
                num_preemptions=5,
            ),
            admin_service_pb2.InstanceStatus(
                instance_id="decode-long-name",
                role=common_pb2.INSTANCE_ROLE_DECODE,
                ready=False,
                num_ranks_connected=1,
                world_size=4,
            ),
        ],
    )


def test_table_has_one_row_per_instance_and_a_daemon_line() -> None:
    lines = format_status(make_response()).splitlines()
    assert len(lines) == 4
    header, i0, d0, daemon = lines
    assert header.split()[:5] == ["instance", "role", "state", "ranks", "slots"]
    assert i0.split() == [
        "i0", "mixed", "paused", "2/2", "12/256", "37.5%", "2560", "3", "12", "41.3", "62.0%", "5",
    ]  # fmt: skip
    # No prefix lookups yet: '-' rather than a division by zero.
    assert d0.split() == [
        "decode-long-name", "decode", "starting", "1/4", "0/0", "0.0%", "0", "0", "0", "0.0", "-", "0",
    ]  # fmt: skip
    assert daemon == "daemon: paused; waiting 3, running 12; 2 instances (1 ready)"


def test_columns_are_aligned() -> None:
    header, i0, d0, _ = format_status(make_response()).splitlines()
    # Left-aligned columns start at the same offset; right-aligned ones end at the same offset.
    assert header.index("role") == i0.index("mixed") == d0.index(" decode ") + 1
    end = header.index("preempt") + len("preempt")
    assert len(header) == len(i0) == len(d0) == end


def test_empty_daemon() -> None:
    text = format_status(admin_service_pb2.GetStatusResponse(draining=True))
    assert "no worker has connected" in text
    assert text.splitlines()[-1] == "daemon: draining; waiting 0, running 0; 0 instances (0 ready)"


def test_unknown_role_value_is_shown_as_number() -> None:
    resp = admin_service_pb2.GetStatusResponse(
        instances=[admin_service_pb2.InstanceStatus(instance_id="x", role=9, ready=True)]
    )
    assert format_status(resp).splitlines()[1].split()[:3] == ["x", "9", "ready"]


def test_step_time_columns_show_predicted_and_measured() -> None:
    resp = make_response()
    i0 = resp.instances[0]
    i0.step_predicted_ewma_ms, i0.step_measured_ewma_ms, i0.itl_target_ms = 24.14, 23.81, 100.0
    header, row0, row1, _ = format_status(resp).splitlines()
    assert header.endswith("step ms pred/meas  ITL target")
    assert row0.split()[-3:] == ["24.1/23.8", "100", "ms"]
    assert row1.split()[-2:] == ["-", "off"]  # nothing measured yet; no target


def test_host_tier_columns_appear_when_an_instance_has_one() -> None:
    resp = make_response()
    i0 = resp.instances[0]
    i0.num_host_blocks, i0.num_free_host_blocks, i0.host_cache_usage = 16384, 12288, 0.25
    i0.prefix_cache_host_hit_tokens = 200
    header, row, other, _ = format_status(resp).splitlines()
    assert "host use" in header and "host hit" in header
    # prefix hit counts either tier (62 %); host hit the share swapped in from host memory.
    assert row.split()[10:] == ["62.0%", "5", "25.0%", "of", "16384", "20.0%"]
    assert other.split()[-2:] == ["-", "-"], "an instance without a host tier shows dashes"
    assert "host" not in format_status(make_response()), "no host tier anywhere: no columns"


def test_encoder_cache_column_appears_when_an_instance_has_one() -> None:
    resp = make_response()
    i0 = resp.instances[0]
    i0.encoder_cache_size, i0.encoder_cache_hits, i0.encoder_cache_misses = 4096, 3, 1
    header, row, other, _ = format_status(resp).splitlines()
    assert header.split()[-2:] == ["enc", "hit"]
    assert row.split()[-1] == "75.0%" and other.split()[-1] == "-"
    assert "enc hit" not in format_status(make_response()), "no encoder cache: no column"


def test_a_cluster_daemon_shows_owners_loads_and_daemons() -> None:
    from kvsched.v1 import admin_service_pb2 as apb

    resp = make_response()
    c = resp.cluster
    c.daemon_id, c.connected, c.num_forwarded = "a", True, 7
    c.daemons.append(apb.ClusterStatus.Daemon(daemon_id="a", address="h:1", instances=["i0"]))
    c.daemons.append(apb.ClusterStatus.Daemon(daemon_id="b", address="h:2", instances=["i9"]))
    c.instances.append(
        apb.ClusterStatus.Instance(
            instance_id="i9", owner_daemon_id="b", load_known=True, num_running=3,
            kv_cache_usage=0.25, num_indexed_blocks=40,
        )
    )  # fmt: skip
    lines = format_status(resp).splitlines()
    assert lines[-3].split() == ["cluster", "instance", "owner", "running", "waiting", "KV",
                                 "use", "indexed", "blocks"]  # fmt: skip
    assert lines[-2].split() == ["i9", "b", "3", "0", "25.0%", "40"]
    assert lines[-1] == (
        "cluster: daemon a, NATS connected; daemons: a (h:1), b (h:2); routed here 0, forwarded 7"
    )
    assert "cluster" not in format_status(make_response())
