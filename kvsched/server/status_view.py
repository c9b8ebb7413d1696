"""`kvsched status`: a GetStatusResponse as a terminal table. Pure: no I/O, no clock.

instance  role   state  ranks  slots    KV use  free blocks  waiting  running  steps/s  prefix hit  preempt  step ms pred/meas  ITL target
i0        mixed  ready  1/1    12/256   37.5%   2560         3        12       41.2     62.0%       0        24.1/23.8          100 ms
daemon: serving; waiting 3, running 12; 1 instance (1 ready)

"state": ready, paused, draining; starting (some of its ranks connected); lost (its workers
disconnected: the daemon forgets an auto-created instance after forget_lost_instance_s); no
worker (configured, never connected).

"step ms pred/meas": moving averages of the worker steps' time as the step-cost model predicted
it and as the worker measured it. Those two columns are left out when no instance reports a
step-cost model (a daemon from before it).

With a host-memory KV tier on any instance, two columns follow "preempt": "host use" (host
blocks in use, of how many) and "host hit" (prompt tokens swapped in from host memory, of the
tokens looked up; "prefix hit" counts hits in either tier).
"""

from __future__ import annotations

from kvsched.v1 import admin_service_pb2, common_pb2

__all__ = ["format_status"]

_BASE_HEADERS = (
    "instance",
    "role",
    "state",
    "ranks",
    "slots",
    "KV use",
    "free blocks",
    "waiting",
    "running",
    "steps/s",
    "prefix hit",
    "preempt",
)
_HOST_HEADERS = ("host use", "host hit")
_ENC_HEADERS = ("enc hit",)  # multimodal items found in the worker's encoder cache
_COST_HEADERS = ("step ms pred/meas", "ITL target")
_RIGHT = frozenset(
    {
        "enc hit",
        "KV use",
        "free blocks",
        "waiting",
        "running",
        "steps/s",
        "prefix hit",
        "preempt",
        "host use",
        "host hit",
    }
)


def _step_ms(inst: admin_service_pb2.InstanceStatus) -> str:
    if inst.step_measured_ewma_ms <= 0:
        return "-"  # no measured step yet
    return f"{inst.step_predicted_ewma_ms:.1f}/{inst.step_measured_ewma_ms:.1f}"


def _target(inst: admin_service_pb2.InstanceStatus) -> str:
    return f"{inst.itl_target_ms:g} ms" if inst.itl_target_ms > 0 else "off"


def _role(value: int) -> str:
    try:
        name: str = common_pb2.InstanceRole.Name(common_pb2.InstanceRole.ValueType(value))
    except ValueError:
        return str(value)
    return name.removeprefix("INSTANCE_ROLE_").lower()


def _state(inst: admin_service_pb2.InstanceStatus) -> str:
    if not inst.ready:
        if inst.num_ranks_connected:
            return "starting"  # some ranks connected, not all yet
        # Its workers are gone (the daemon forgets it after forget_lost_instance_s), or it is
        # configured and no worker ever connected.
        return "lost" if inst.model else "no worker"
    if inst.paused:
        return "paused"
    if inst.draining:
        return "draining"
    return "ready"


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _host(inst: admin_service_pb2.InstanceStatus) -> tuple[str, ...]:
    if inst.num_host_blocks == 0:
        return ("-", "-")
    return (
        f"{100.0 * inst.host_cache_usage:.1f}% of {inst.num_host_blocks}",
        _percent(inst.prefix_cache_host_hit_tokens, inst.prefix_cache_query_tokens),
    )


def _enc(inst: admin_service_pb2.InstanceStatus) -> tuple[str, ...]:
    if inst.encoder_cache_size == 0:
        return ("-",)
    items = inst.encoder_cache_hits + inst.encoder_cache_misses
    return (_percent(inst.encoder_cache_hits, items),)


def _row(
    inst: admin_service_pb2.InstanceStatus, host: bool, enc: bool, cost: bool
) -> tuple[str, ...]:
    return (
        *_base(inst),
        *(_host(inst) if host else ()),
        *(_enc(inst) if enc else ()),
        *((_step_ms(inst), _target(inst)) if cost else ()),
    )


def _base(inst: admin_service_pb2.InstanceStatus) -> tuple[str, ...]:
    return (
        inst.instance_id,
        _role(inst.role),
        _state(inst),
        f"{inst.num_ranks_connected}/{inst.world_size}",
        f"{inst.num_slots_used}/{inst.num_slots}",
        f"{100.0 * inst.kv_cache_usage:.1f}%",
        str(inst.num_free_blocks),
        str(inst.num_waiting),
        str(inst.num_running),
        f"{inst.steps_per_s:.1f}",
        _percent(inst.prefix_cache_hit_tokens, inst.prefix_cache_query_tokens),
        str(inst.num_preemptions),
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if header in _RIGHT else cell.ljust(w)
            for cell, w, header in zip(row, widths, rows[0], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _daemon_line(resp: admin_service_pb2.GetStatusResponse) -> str:
    modes = [m for m, on in (("draining", resp.draining), ("paused", resp.paused)) if on]
    num = len(resp.instances)
    num_ready = sum(1 for inst in resp.instances if inst.ready)
    noun = "instance" if num == 1 else "instances"
    return (
        f"daemon: {', '.join(modes) or 'serving'}; waiting {resp.num_waiting}, "
        f"running {resp.num_running}; {num} {noun} ({num_ready} ready)"
    )


_CLUSTER_HEADERS = ("cluster instance", "owner", "running", "waiting", "KV use", "indexed blocks")


def _cluster_lines(c: admin_service_pb2.ClusterStatus) -> list[str]:
    """A cluster daemon's view: every instance's owner and load, then the daemons."""
    rows: list[tuple[str, ...]] = [_CLUSTER_HEADERS]
    for i in c.instances:
        known = i.load_known
        rows.append(
            (
                i.instance_id,
                i.owner_daemon_id or "-",
                f"{i.num_running:g}" if known else "-",
                f"{i.num_waiting:g}" if known else "-",
                f"{100.0 * i.kv_cache_usage:.1f}%" if known else "-",
                str(i.num_indexed_blocks),
            )
        )
    widths = [max(len(r[k]) for r in rows) for k in range(len(_CLUSTER_HEADERS))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    daemons = ", ".join(f"{d.daemon_id} ({d.address})" for d in c.daemons) or "-"
    lines.append(
        f"cluster: daemon {c.daemon_id}, NATS {'connected' if c.connected else 'UNREACHABLE'}; "
        f"daemons: {daemons}; routed here {c.num_routed_local}, forwarded {c.num_forwarded}"
    )
    return lines


def format_status(resp: admin_service_pb2.GetStatusResponse) -> str:
    """One row per instance, in the response's order, then a line about the whole daemon;
    in a cluster, the cluster's instances (owner, load) and daemons after it."""
    cost = any(i.itl_target_ms > 0 or i.step_measured_ewma_ms > 0 for i in resp.instances)
    host = any(i.num_host_blocks > 0 for i in resp.instances)
    enc = any(i.encoder_cache_size > 0 for i in resp.instances)
    headers = (
        _BASE_HEADERS
        + (_HOST_HEADERS if host else ())
        + (_ENC_HEADERS if enc else ())
        + (_COST_HEADERS if cost else ())
    )
    # Grouped by model (a column, its rows together) when the instances serve more than one.
    models = {i.model for i in resp.instances if i.model}
    insts = list(resp.instances)
    if len(models) > 1:
        insts.sort(key=lambda i: i.model)
        headers = ("model", *headers)
    rows = [_row(inst, host, enc, cost) for inst in insts]
    if len(models) > 1:
        rows = [(inst.model or "-", *row) for inst, row in zip(insts, rows, strict=True)]
    lines = _table([headers, *rows])
    if not resp.instances:
        lines.append("(no instances: no worker has connected)")
    lines.append(_daemon_line(resp))
    if resp.HasField("cluster"):
        lines.extend(_cluster_lines(resp.cluster))
    return "\n".join(lines)
