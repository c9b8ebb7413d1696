"""Conversion between the core's protocol dataclasses and the kvsched.v1 protobuf messages.

The only module that imports both `kvsched.core` and `kvsched.v1` (STYLE rule 8). Hot-path
messages are columnar (DESIGN section 4): building one fills a handful of packed repeated fields
from flat Python lists; reading one copies each column once: to a list with `pb.field[:]`
(~17 us for 1,024 ids), or, for the StepReport's per-row columns, to a numpy array with
`np.array(pb.field)` (~3 us).

Whatever comes off the network is checked for shape here: a message whose parallel columns
disagree in length raises `ValueError` naming the columns. Whether the handles in it make sense
is the daemon's business, not this module's.

    core.Tasks --tasks_to_proto / tasks_to_bytes--> worker     (daemon side)
    worker --tasks_from_proto--> core.Tasks                    (worker side)
    core.StepReport --report_to_proto--> daemon                (worker side)
    daemon --report_from_proto--> core.StepReport              (daemon side)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from typing import cast

import numpy as np

from kvsched.core import protocol as core
from kvsched.core.config import Role
from kvsched.core.request import Request
from kvsched.v1 import common_pb2, request_service_pb2, worker_service_pb2

PROTOCOL_VERSION = 1
"""The worker protocol's version, sent in Hello and Welcome."""

_FINISH_REASONS = frozenset(int(r) for r in core.FinishReason)
_MAX_FINISH_REASON = max(_FINISH_REASONS)


# --- enums ------------------------------------------------------------------------------------


def finish_reason_to_proto(reason: core.FinishReason) -> common_pb2.FinishReason.ValueType:
    """The proto enum value of `reason` (the values are equal by design)."""
    return common_pb2.FinishReason.ValueType(int(reason))


def finish_reason_from_proto(value: int) -> core.FinishReason:
    """The core reason for a proto enum value; `ValueError` for a value this version lacks."""
    if value not in _FINISH_REASONS:
        raise ValueError(f"unknown FinishReason {value}; this daemon knows 0-{_MAX_FINISH_REASON}")
    return core.FinishReason(value)


_ROLE_TO_PROTO = {
    Role.MIXED: common_pb2.INSTANCE_ROLE_MIXED,
    Role.PREFILL: common_pb2.INSTANCE_ROLE_PREFILL,
    Role.DECODE: common_pb2.INSTANCE_ROLE_DECODE,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}


def role_to_proto(role: Role) -> common_pb2.InstanceRole.ValueType:
    return _ROLE_TO_PROTO[role]


def role_from_proto(value: int) -> Role:
    """The core role; `ValueError` for UNSPECIFIED or a value this version lacks."""
    role = _ROLE_FROM_PROTO.get(common_pb2.InstanceRole.ValueType(value))
    if role is None:
        raise ValueError(f"InstanceRole {value} is not one of {sorted(_ROLE_FROM_PROTO)}")
    return role


# --- request-level messages -------------------------------------------------------------------


def sampling_to_proto(params: core.SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )


def sampling_from_proto(
    pb: common_pb2.SamplingParams, default_max_tokens: int | None = None
) -> core.SamplingParams:
    """Core sampling params. Absent max_tokens takes `default_max_tokens` (else the core's
    default); absent top_p is 1.0. Ranges are not checked here: the request handler does that."""
    params = core.SamplingParams(
        min_tokens=pb.min_tokens,
        temperature=pb.temperature,
        top_k=pb.top_k,
        seed=pb.seed,
        stop_token_ids=pb.stop_token_ids[:],
        ignore_eos=pb.ignore_eos,
    )
    if pb.HasField("max_tokens"):
        params.max_tokens = pb.max_tokens
    elif default_max_tokens is not None:
        params.max_tokens = default_max_tokens
    if pb.HasField("top_p"):
        params.top_p = pb.top_p
    return params


def mm_ranges_to_proto(ranges: Iterable[core.MultimodalRange]) -> list[common_pb2.MultimodalRange]:
    return [
        common_pb2.MultimodalRange(offset=r.offset, length=r.length, content_hash=r.content_hash)
        for r in ranges
    ]


def mm_ranges_from_proto(
    pbs: Iterable[common_pb2.MultimodalRange],
) -> list[core.MultimodalRange]:
    return [core.MultimodalRange(pb.offset, pb.length, pb.content_hash) for pb in pbs]


# --- Tasks (daemon -> worker) -----------------------------------------------------------------


def placement_to_proto(p: core.Placement) -> worker_service_pb2.Placement:
    return worker_service_pb2.Placement(
        handle=p.handle,
        slot=p.slot,
        request_id=p.req_id,
        block_ids=p.block_ids,
        num_cached_tokens=p.num_cached_tokens,
        num_prefill_tokens=p.num_prefill_tokens,
        num_output_tokens=p.num_output_tokens,
        last_token_id=p.last_token_id,
        sampling=sampling_to_proto(p.sampling),
        lora_name=p.lora_name,
    )


def placement_from_proto(pb: worker_service_pb2.Placement) -> core.Placement:
    return core.Placement(
        handle=pb.handle,
        slot=pb.slot,
        req_id=pb.request_id,
        block_ids=pb.block_ids[:],
        num_cached_tokens=pb.num_cached_tokens,
        num_prefill_tokens=pb.num_prefill_tokens,
        num_output_tokens=pb.num_output_tokens,
        last_token_id=pb.last_token_id,
        sampling=sampling_from_proto(pb.sampling),
        lora_name=pb.lora_name,
    )


def tasks_to_proto(tasks: core.Tasks) -> worker_service_pb2.Tasks:
    """The columnar message for `tasks`."""
    pb = worker_service_pb2.Tasks()
    _fill_tasks(pb, tasks)
    return pb


def tasks_to_bytes(tasks: core.Tasks) -> bytes:
    """A serialized `ConnectResponse` carrying `tasks`: build and serialize once, then write the
    same bytes to every tensor-parallel rank. The stream must then be registered with an identity
    response serializer (`response_serializer=None`), and its other messages sent as
    `msg.SerializeToString()` too."""
    response = worker_service_pb2.ConnectResponse()
    response.tasks.SetInParent()
    _fill_tasks(response.tasks, tasks)
    return response.SerializeToString()


def _fill_tasks(pb: worker_service_pb2.Tasks, tasks: core.Tasks) -> None:
    pb.seq = tasks.seq
    pb.reset_prefix_cache = tasks.reset_prefix_cache
    pb.report_step = tasks.report_step
    if tasks.preempts:
        pb.preempts.extend(tasks.preempts)
    if tasks.aborts:
        pb.aborts.extend(tasks.aborts)
    if tasks.placements:
        pb.placements.extend([placement_to_proto(p) for p in tasks.placements])
    if tasks.extensions:
        exts = tasks.extensions
        pb.extensions.handles.extend([e.handle for e in exts])
        pb.extensions.num_block_ids.extend([len(e.block_ids) for e in exts])
        pb.extensions.block_ids.extend(chain.from_iterable([e.block_ids for e in exts]))
    if tasks.chunks:
        chunks = tasks.chunks
        pb.chunks.handles.extend([c.handle for c in chunks])
        pb.chunks.starts.extend([c.start for c in chunks])
        pb.chunks.num_tokens.extend([len(c.token_ids) for c in chunks])
        pb.chunks.token_ids.extend(chain.from_iterable([c.token_ids for c in chunks]))
    if tasks.kv_sends:
        sends = tasks.kv_sends
        pb.kv_sends.handles.extend([s.handle for s in sends])
        pb.kv_sends.dst_instances.extend([s.dst_instance for s in sends])
        pb.kv_sends.dst_handles.extend([s.dst_handle for s in sends])
        pb.kv_sends.num_dst_block_ids.extend([len(s.dst_block_ids) for s in sends])
        pb.kv_sends.dst_block_ids.extend(chain.from_iterable([s.dst_block_ids for s in sends]))


def tasks_from_proto(pb: worker_service_pb2.Tasks) -> core.Tasks:
    """Core tasks from the message; `ValueError` if its columns disagree (worker side)."""
    ext, chk, snd = pb.extensions, pb.chunks, pb.kv_sends
    ext_handles = ext.handles[:]
    ext_blocks = _split(
        "extensions", ext_handles, ext.num_block_ids[:], "block_ids", ext.block_ids[:]
    )
    chk_handles, chk_starts = chk.handles[:], chk.starts[:]
    _check_parallel("chunks", handles=chk_handles, starts=chk_starts)
    chk_tokens = _split("chunks", chk_handles, chk.num_tokens[:], "token_ids", chk.token_ids[:])
    snd_handles, snd_dst = snd.handles[:], snd.dst_instances[:]
    snd_dst_handles = snd.dst_handles[:]
    _check_parallel(
        "kv_sends", handles=snd_handles, dst_instances=snd_dst, dst_handles=snd_dst_handles
    )
    snd_blocks = _split(
        "kv_sends",
        snd_handles,
        snd.num_dst_block_ids[:],
        "dst_block_ids",
        snd.dst_block_ids[:],
    )
    return core.Tasks(
        seq=pb.seq,
        preempts=pb.preempts[:],
        aborts=pb.aborts[:],
        placements=[placement_from_proto(p) for p in pb.placements],
        extensions=list(map(core.Extension, ext_handles, ext_blocks)),
        chunks=list(map(core.Chunk, chk_handles, chk_starts, chk_tokens)),
        kv_sends=list(map(core.KvSend, snd_handles, snd_dst, snd_dst_handles, snd_blocks)),
        reset_prefix_cache=pb.reset_prefix_cache,
        report_step=pb.report_step,
    )


def _split(
    kind: str, handles: list[int], counts: list[int], flat_name: str, flat: list[int]
) -> list[list[int]]:
    """Cut `flat` into len(counts) consecutive lists of counts[i] items."""
    if len(counts) != len(handles):
        raise ValueError(f"{kind}: {len(handles)} handles but {len(counts)} counts of {flat_name}")
    total = sum(counts)
    if total != len(flat):
        raise ValueError(
            f"{kind}: counts add up to {total} {flat_name} but the message has {len(flat)}"
        )
    out: list[list[int]] = []
    pos = 0
    for n in counts:
        out.append(flat[pos : pos + n])
        pos += n
    return out


def _check_parallel(kind: str, **columns: Sequence[object]) -> None:
    lengths = {name: len(col) for name, col in columns.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"{kind}: parallel columns differ in length ({shown})")


# --- StepReport (worker -> daemon) ------------------------------------------------------------
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def report_to_proto(report: core.StepReport) -> worker_service_pb2.StepReport:
    return worker_service_pb2.StepReport(
        step=report.step,
        applied_seq=report.applied_seq,
        handles=report.handles,
        num_computed=report.num_computed,
        num_new_tokens=report.num_new_tokens,
        token_ids=report.token_ids,
        finish_reasons=cast("list[common_pb2.FinishReason.ValueType]", report.finish_reasons),
        acked=report.acked,
        paused=report.paused,
        failed=report.failed,
        step_time_ns=report.step_time_ns,
    )


def report_from_proto(pb: worker_service_pb2.StepReport) -> core.StepReport:
    """Core report from the message (daemon side): the per-row columns as numpy arrays (one C
    copy each, ~3 us for 1,024 rows; the core's decode path is vectorized over them), the
    rare columns as lists. No per-row Python objects.

    Raises `ValueError` if the per-handle columns differ in length, if num_new_tokens does not
    add up to len(token_ids), or if a finish reason is unknown.
    """
    n = len(pb.handles)
    handles = np.array(pb.handles, dtype=np.int64) if n else _EMPTY
    num_computed = np.array(pb.num_computed, dtype=np.int64) if len(pb.num_computed) else _EMPTY
    num_new_tokens = (
        np.array(pb.num_new_tokens, dtype=np.int64) if len(pb.num_new_tokens) else _EMPTY
    )
    token_ids = np.array(pb.token_ids, dtype=np.int64) if len(pb.token_ids) else _EMPTY
    # Open enum: plain ints. A column like the others (the core recognises "none finished"
    # by comparing bytes, not by converting a list).
    finish_reasons = (
        np.array(pb.finish_reasons, dtype=np.int64) if len(pb.finish_reasons) else _EMPTY
    )
    if len(num_computed) != n or len(num_new_tokens) != n or len(finish_reasons) not in (0, n):
        _check_parallel(  # (finish_reasons may also be empty: nothing finished)
            "StepReport",
            handles=handles,
            num_computed=num_computed,
            num_new_tokens=num_new_tokens,
            finish_reasons=finish_reasons,
        )
    num_sampled = int(num_new_tokens.sum())
    if num_sampled != len(token_ids):
        raise ValueError(
            f"StepReport: num_new_tokens add up to {num_sampled} "
            f"but the report has {len(token_ids)} token_ids"
        )
    if len(finish_reasons) and (
        int(finish_reasons.min()) < 0 or int(finish_reasons.max()) > _MAX_FINISH_REASON
    ):
        bad = sorted({r for r in finish_reasons.tolist() if r not in _FINISH_REASONS})
        raise ValueError(f"StepReport: unknown finish reasons {bad}")
    return core.StepReport(
        step=pb.step,
        applied_seq=pb.applied_seq,
        handles=handles,
        num_computed=num_computed,
        num_new_tokens=num_new_tokens,
        token_ids=token_ids,
        finish_reasons=finish_reasons,
        acked=pb.acked[:],
        paused=pb.paused[:],
        failed=pb.failed[:],
        step_time_ns=pb.step_time_ns,
    )


# --- front-end requests and results -------------------------------------------------------------


def request_from_proto(
    pb: request_service_pb2.GenerateRequest, req_id: str, arrival_time: float
) -> Request:
    """A core request from a GenerateRequest. Field ranges are checked by the scheduler."""
    return Request(
        req_id=req_id,
        prompt_token_ids=pb.prompt_token_ids[:],
        sampling=sampling_from_proto(pb.sampling),
        priority=pb.priority,
        arrival_time=arrival_time,
        lora_name=pb.lora_name,
        cache_salt=pb.cache_salt,
        mm_ranges=mm_ranges_from_proto(pb.mm_ranges),
    )


def finished_to_proto(req: Request) -> request_service_pb2.Finished:
    """The `Finished` message for a finished request: reason, usage, timings, message."""
    t0 = req.arrival_time
    sched = req.first_scheduled_time
    first = req.first_token_time
    return request_service_pb2.Finished(
        request_id=req.req_id,
        reason=finish_reason_to_proto(req.finish_reason),
        usage=common_pb2.Usage(
            prompt_tokens=len(req.prompt_token_ids),
            output_tokens=len(req.output_token_ids),
            cached_tokens=max(0, req.num_cached_tokens),
        ),
        timings=common_pb2.Timings(
            queue_s=max(0.0, sched - t0) if sched >= 0 else 0.0,
            ttft_s=max(0.0, first - t0) if first >= 0 else 0.0,
            e2e_s=max(0.0, req.finished_time - t0),
        ),
        message=req.finish_message,
    )
