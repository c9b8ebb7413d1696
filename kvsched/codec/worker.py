"""The worker protocol's hot-path messages (`worker_service.proto`): Tasks and StepReport, on
both sides of the stream, one implementation per direction.

    core.Tasks --tasks_to_proto / tasks_to_bytes--> worker     (daemon side)
    worker --tasks_from_proto--> core.Tasks                    (worker side)
    core.StepReport --report_message / report_to_proto--> daemon   (worker side)
    daemon --report_from_proto--> core.StepReport              (daemon side)

The messages are columnar (see the Tasks and StepReport comments in the proto): building one
fills a handful of packed repeated fields from flat Python lists; reading one copies each column
once, to a list with `pb.field[:]` (~17 us for 1,024 ids), or, for the StepReport's per-row
columns on the daemon side, to a numpy array with `np.array(pb.field)` (~3 us).

Measured at 1,024 decoding slots (bench.worker_step, protobuf 7.36 upb): filling a packed column
with extend(list) costs ~20 ns an item, extend(numpy array) ~3x more (each item is converted on
its own), so the worker's columns go in as lists. A list column whose items are all one value
below 128 (num_new_tokens of a plain decode step, finish_reasons of a step where nothing
finished) is written as its packed wire bytes instead: ~4 us instead of ~20 us.

Whatever comes off the network is checked for shape here: a message whose parallel columns
disagree in length raises `ValueError` naming the columns. Whether the handles in it make sense
is the receiver's business, not this module's.
"""

from __future__ import annotations

from collections.abc import Sized
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from kvsched.codec.common import (
    FINISH_REASONS,
    MAX_FINISH_REASON,
    logprobs_from_proto,
    logprobs_to_proto,
    mm_ranges_from_proto,
    mm_ranges_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from kvsched.core import protocol as core
from kvsched.v1 import worker_service_pb2

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedScalarFieldContainer

PROTOCOL_VERSION = 1
"""The worker protocol's version, sent in Hello and Welcome."""

_NUM_NEW_TOKENS_FIELD = worker_service_pb2.StepReport.DESCRIPTOR.fields_by_name[
    "num_new_tokens"
].number
_FINISH_REASONS_FIELD = worker_service_pb2.StepReport.DESCRIPTOR.fields_by_name[
    "finish_reasons"
].number


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
        mm_ranges=mm_ranges_to_proto(p.mm_ranges) if p.mm_ranges else None,
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
        mm_ranges=mm_ranges_from_proto(pb.mm_ranges) if pb.mm_ranges else [],
    )


def tasks_to_proto(tasks: core.Tasks) -> worker_service_pb2.Tasks:
    """The columnar message for `tasks`."""
    pb = worker_service_pb2.Tasks()
    _fill_tasks(pb, tasks)
    return pb


def tasks_to_bytes(tasks: core.Tasks, fencing_epoch: int = 0) -> bytes:
    """A serialized `ConnectResponse` carrying `tasks`: build and serialize once, then write the
    same bytes to every tensor-parallel rank. The stream must then be registered with an identity
    response serializer (`response_serializer=None`), and its other messages sent as
    `msg.SerializeToString()` too."""
    response = worker_service_pb2.ConnectResponse()
    response.tasks.SetInParent()
    _fill_tasks(response.tasks, tasks)
    response.tasks.fencing_epoch = fencing_epoch  # the daemon's lease epoch (0: unfenced)
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
    if tasks.swap_out_gpu:
        pb.swap_outs.gpu_block_ids.extend(tasks.swap_out_gpu)
        pb.swap_outs.host_block_ids.extend(tasks.swap_out_host)
    if tasks.swap_in_gpu:
        pb.swap_ins.handles.extend(tasks.swap_in_handles)
        pb.swap_ins.host_block_ids.extend(tasks.swap_in_host)
        pb.swap_ins.gpu_block_ids.extend(tasks.swap_in_gpu)
    if tasks.encoder_drops:
        pb.encoder_drops.extend(tasks.encoder_drops)
    if tasks.storage_write_keys:
        pb.storage_writes.keys.extend(tasks.storage_write_keys)
        pb.storage_writes.block_ids.extend(tasks.storage_write_blocks)
    if tasks.storage_fetch_keys:
        pb.storage_fetches.handles.extend(tasks.storage_fetch_handles)
        pb.storage_fetches.keys.extend(tasks.storage_fetch_keys)
        pb.storage_fetches.gpu_block_ids.extend(tasks.storage_fetch_gpu)
    if tasks.storage_prefetch_keys:
        pb.storage_prefetches.keys.extend(tasks.storage_prefetch_keys)
        pb.storage_prefetches.host_block_ids.extend(tasks.storage_prefetch_host)
    if tasks.kv_sends:
        sends = tasks.kv_sends
        pb.kv_sends.handles.extend([s.handle for s in sends])
        pb.kv_sends.dst_instances.extend([s.dst_instance for s in sends])
        pb.kv_sends.dst_handles.extend([s.dst_handle for s in sends])
        pb.kv_sends.num_dst_block_ids.extend([len(s.dst_block_ids) for s in sends])
        pb.kv_sends.dst_block_ids.extend(chain.from_iterable([s.dst_block_ids for s in sends]))


def tasks_from_proto(msg: worker_service_pb2.Tasks) -> core.Tasks:
    """Core tasks from the message; `ValueError` if its columns disagree. Empty sections cost
    nothing (a decode step's Tasks usually carry only a few extensions)."""
    tasks = core.Tasks(
        seq=msg.seq, reset_prefix_cache=msg.reset_prefix_cache, report_step=msg.report_step
    )
    if msg.preempts:
        tasks.preempts = msg.preempts[:]
    if msg.aborts:
        tasks.aborts = msg.aborts[:]
    if msg.placements:
        tasks.placements = [placement_from_proto(p) for p in msg.placements]
    if msg.encoder_drops:
        tasks.encoder_drops = msg.encoder_drops[:]
    ext, chk, snd = msg.extensions, msg.chunks, msg.kv_sends
    outs, ins = msg.swap_outs, msg.swap_ins
    if outs.gpu_block_ids or outs.host_block_ids:
        tasks.swap_out_gpu, tasks.swap_out_host = outs.gpu_block_ids[:], outs.host_block_ids[:]
        _check_parallel(
            "swap_outs", gpu_block_ids=tasks.swap_out_gpu, host_block_ids=tasks.swap_out_host
        )
    if ins.handles or ins.host_block_ids or ins.gpu_block_ids:
        tasks.swap_in_handles = ins.handles[:]
        tasks.swap_in_host, tasks.swap_in_gpu = ins.host_block_ids[:], ins.gpu_block_ids[:]
        _check_parallel(
            "swap_ins",
            handles=tasks.swap_in_handles,
            host_block_ids=tasks.swap_in_host,
            gpu_block_ids=tasks.swap_in_gpu,
        )
    sw, sf = msg.storage_writes, msg.storage_fetches
    if sw.keys or sw.block_ids:
        tasks.storage_write_keys, tasks.storage_write_blocks = sw.keys[:], sw.block_ids[:]
        _check_parallel(
            "storage_writes", keys=tasks.storage_write_keys, block_ids=tasks.storage_write_blocks
        )
    if sf.handles or sf.keys or sf.gpu_block_ids:
        tasks.storage_fetch_handles, tasks.storage_fetch_keys = sf.handles[:], sf.keys[:]
        tasks.storage_fetch_gpu = sf.gpu_block_ids[:]
        _check_parallel(
            "storage_fetches",
            handles=tasks.storage_fetch_handles,
            keys=tasks.storage_fetch_keys,
            gpu_block_ids=tasks.storage_fetch_gpu,
        )
    sp = msg.storage_prefetches
    if sp.keys or sp.host_block_ids:
        tasks.storage_prefetch_keys = sp.keys[:]
        tasks.storage_prefetch_host = sp.host_block_ids[:]
        _check_parallel(
            "storage_prefetches",
            keys=tasks.storage_prefetch_keys,
            host_block_ids=tasks.storage_prefetch_host,
        )
    if ext.handles or ext.num_block_ids or ext.block_ids:
        handles = ext.handles[:]
        blocks = _split("extensions", handles, ext.num_block_ids[:], "block_ids", ext.block_ids[:])
        tasks.extensions = list(map(core.Extension, handles, blocks))
    if chk.handles or chk.starts or chk.num_tokens or chk.token_ids:
        handles, starts = chk.handles[:], chk.starts[:]
        _check_parallel("chunks", handles=handles, starts=starts)
        tokens = _split("chunks", handles, chk.num_tokens[:], "token_ids", chk.token_ids[:])
        tasks.chunks = list(map(core.Chunk, handles, starts, tokens))
    if (
        snd.handles
        or snd.dst_instances
        or snd.dst_handles
        or snd.num_dst_block_ids
        or snd.dst_block_ids
    ):
        handles, dst, dst_handles = snd.handles[:], snd.dst_instances[:], snd.dst_handles[:]
        _check_parallel("kv_sends", handles=handles, dst_instances=dst, dst_handles=dst_handles)
        blocks = _split(
            "kv_sends", handles, snd.num_dst_block_ids[:], "dst_block_ids", snd.dst_block_ids[:]
        )
        tasks.kv_sends = list(map(core.KvSend, handles, dst, dst_handles, blocks))
    return tasks


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


def _check_parallel(kind: str, **columns: Sized) -> None:
    lengths = {name: len(col) for name, col in columns.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"{kind}: parallel columns differ in length ({shown})")


# --- StepReport (worker -> daemon) ------------------------------------------------------------


def report_message(report: core.StepReport) -> worker_service_pb2.ConnectRequest:
    """The ConnectRequest carrying `report`: what the worker sends after a step."""
    msg = worker_service_pb2.ConnectRequest()
    _fill_report(msg.report, report)
    return msg


def report_to_proto(report: core.StepReport) -> worker_service_pb2.StepReport:
    """The StepReport message alone (the same fields report_message fills)."""
    pb = worker_service_pb2.StepReport()
    _fill_report(pb, report)
    return pb


def _fill_report(r: worker_service_pb2.StepReport, report: core.StepReport) -> None:
    r.step = report.step
    r.applied_seq = report.applied_seq
    r.step_time_ns = report.step_time_ns
    r.handles.extend(report.handles)
    r.num_computed.extend(report.num_computed)
    r.token_ids.extend(report.token_ids)
    _fill(r, _NUM_NEW_TOKENS_FIELD, r.num_new_tokens, report.num_new_tokens)
    _fill(r, _FINISH_REASONS_FIELD, r.finish_reasons, report.finish_reasons)  # type: ignore[arg-type]
    if report.acked:
        r.acked.extend(report.acked)
    if report.paused:
        r.paused.extend(report.paused)
    if report.failed:
        r.failed.extend(report.failed)
    if report.failed_swap_outs:
        r.failed_swap_outs.extend(report.failed_swap_outs)
    if report.failed_swap_ins:
        r.failed_swap_ins.extend(report.failed_swap_ins)
    if report.failed_storage_writes:
        r.failed_storage_writes.extend(report.failed_storage_writes)
    if report.failed_storage_fetches:
        r.failed_storage_fetches.extend(report.failed_storage_fetches)
    if report.draft_handles:
        r.draft_handles.extend(report.draft_handles)
        r.num_draft_tokens.extend(report.num_draft_tokens)
        r.num_accepted_drafts.extend(report.num_accepted_drafts)
    if report.num_logprobs and report.logprobs is not None:
        r.num_logprobs.extend(report.num_logprobs)
        logprobs_to_proto(report.logprobs, r.logprobs)
    if report.prompt_logprob_handles and report.prompt_logprobs is not None:
        r.prompt_logprob_handles.extend(report.prompt_logprob_handles)
        r.num_prompt_logprobs.extend(report.num_prompt_logprobs)
        logprobs_to_proto(report.prompt_logprobs, r.prompt_logprobs)
    if report.failed_storage_prefetches:
        r.failed_storage_prefetches.extend(report.failed_storage_prefetches)


def _fill(
    r: worker_service_pb2.StepReport,
    field: int,
    column: RepeatedScalarFieldContainer[int],
    values: core.IntColumn,
) -> None:
    """Append values to a packed varint column: a list whose items are all one value below 128
    as its wire bytes (one byte each), anything else (numpy arrays too) through extend."""
    n = len(values)
    if n and type(values) is list and 0 <= values[0] < 128 and values.count(values[0]) == n:
        r.MergeFromString(bytes((field << 3 | 2,)) + _varint(n) + bytes((values[0],)) * n)
    else:
        column.extend(values)


def merge_reports(
    held: worker_service_pb2.StepReport, later: worker_service_pb2.StepReport
) -> None:
    """`later` appended to `held` (a worker's merged report): the columns concatenated, the later
    step; num_logprobs padded with zeros where only one of them has it (parallel to handles)."""
    if len(held.num_logprobs) != len(later.num_logprobs) and not (
        len(held.num_logprobs) and len(later.num_logprobs)
    ):
        for r in (held, later):
            if not len(r.num_logprobs):
                r.num_logprobs.extend([0] * len(r.handles))
    held.MergeFrom(later)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


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
        int(finish_reasons.min()) < 0 or int(finish_reasons.max()) > MAX_FINISH_REASON
    ):
        bad = sorted({r for r in finish_reasons.tolist() if r not in FINISH_REASONS})
        raise ValueError(f"StepReport: unknown finish reasons {bad}")
    draft_handles = pb.draft_handles[:] if len(pb.draft_handles) else []
    if not len(draft_handles) == len(pb.num_draft_tokens) == len(pb.num_accepted_drafts):
        _check_parallel(
            "StepReport",
            draft_handles=draft_handles,
            num_draft_tokens=pb.num_draft_tokens,
            num_accepted_drafts=pb.num_accepted_drafts,
        )
    report = core.StepReport(
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
        failed_swap_outs=pb.failed_swap_outs[:],
        failed_swap_ins=pb.failed_swap_ins[:],
        failed_storage_writes=pb.failed_storage_writes[:],
        failed_storage_fetches=pb.failed_storage_fetches[:],
        draft_handles=draft_handles,
        num_draft_tokens=pb.num_draft_tokens[:] if draft_handles else [],
        num_accepted_drafts=pb.num_accepted_drafts[:] if draft_handles else [],
        failed_storage_prefetches=pb.failed_storage_prefetches[:],
    )
    if len(pb.num_logprobs) or len(pb.prompt_logprob_handles):
        _logprobs_from_proto(pb, report, num_new_tokens)
    return report


def _logprobs_from_proto(
    pb: worker_service_pb2.StepReport, report: core.StepReport, num_new: np.ndarray
) -> None:
    """A report's log-probability columns (only reports of requests that asked have them),
    checked: ValueError naming what does not add up."""
    if len(pb.num_logprobs):
        if len(pb.num_logprobs) != len(num_new):
            raise ValueError(
                f"StepReport: {len(pb.num_logprobs)} num_logprobs for {len(num_new)} handles"
            )
        report.num_logprobs = pb.num_logprobs[:]
        report.logprobs = logprobs_from_proto(pb.logprobs)
        if any(n and n != t for n, t in zip(report.num_logprobs, num_new.tolist(), strict=True)):
            raise ValueError("StepReport: num_logprobs[i] must be 0 or num_new_tokens[i]")
    if len(pb.prompt_logprob_handles):
        report.prompt_logprob_handles = pb.prompt_logprob_handles[:]
        report.num_prompt_logprobs = pb.num_prompt_logprobs[:]
        report.prompt_logprobs = logprobs_from_proto(pb.prompt_logprobs)
        if len(report.num_prompt_logprobs) != len(report.prompt_logprob_handles):
            raise ValueError("StepReport: prompt_logprob_handles and num_prompt_logprobs differ")
    for name, lp, counts in (
        ("logprobs", report.logprobs, report.num_logprobs),
        ("prompt_logprobs", report.prompt_logprobs, report.num_prompt_logprobs),
    ):
        if lp is None:
            continue
        wrong = lp.check() or (
            "" if sum(counts) == len(lp) else f"{sum(counts)} rows named, {len(lp)} sent"
        )
        if wrong:
            raise ValueError(f"StepReport.{name}: {wrong}")
