"""`kvsched status`: a GetStatusResponse as a terminal table. Pure: no I/O, no clock.

instance  role   state  ranks  slots    KV use  free blocks  waiting  running  steps/s  prefix hit  preempt
i0        mixed  ready  1/1    12/256   37.5%   2560         3        12       41.2     62.0%       0
daemon: serving; waiting 3, running 12; 1 instance (1 ready)
"""

from __future__ import annotations

from kvsched.v1 import admin_service_pb2, common_pb2

__all__ = ["format_status"]

_HEADERS = (
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
_RIGHT = frozenset(
    {"KV use", "free blocks", "waiting", "running", "steps/s", "prefix hit", "preempt"}
)


def _role(value: int) -> str:
    try:
        name: str = common_pb2.InstanceRole.Name(common_pb2.InstanceRole.ValueType(value))
    except ValueError:
        return str(value)
    return name.removeprefix("INSTANCE_ROLE_").lower()


def _state(inst: admin_service_pb2.InstanceStatus) -> str:
    if not inst.ready:
        return "starting"
    if inst.paused:
        return "paused"
    if inst.draining:
        return "draining"
    return "ready"


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _row(inst: admin_service_pb2.InstanceStatus) -> tuple[str, ...]:
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
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADERS))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if header in _RIGHT else cell.ljust(w)
            for cell, w, header in zip(row, widths, _HEADERS, strict=True)
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


def format_status(resp: admin_service_pb2.GetStatusResponse) -> str:
    """One row per instance, in the response's order, then a line about the whole daemon."""
    lines = _table([_HEADERS, *(_row(inst) for inst in resp.instances)])
    if not resp.instances:
        lines.append("(no instances: no worker has connected)")
    lines.append(_daemon_line(resp))
    return "\n".join(lines)
