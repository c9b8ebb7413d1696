"""The worker's side of the hot-path messages (DESIGN 4): Tasks in, StepReport out, built for
the least CPU per step. Same messages and checks as kvsched.server.convert's tasks_from_proto
and report_to_proto (the daemon's side keeps using those).

Measured at 1,024 decoding slots (bench.worker_step, protobuf 7.36 upb): filling a packed
column with extend(list) costs ~20 ns an item, extend(numpy array) ~3x more (each item is
converted on its own), so columns go in as lists. A column whose items are all one value below
128 (num_new_tokens of a plain decode step, finish_reasons of a step where nothing finished)
is written as its packed wire bytes instead: ~4 us instead of ~20 us.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsched.core.protocol import Chunk, Extension, KvSend, StepReport, Tasks
from kvsched.server import convert
from kvsched.v1 import worker_service_pb2 as pb

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedScalarFieldContainer

__all__ = ["report_message", "tasks_from_proto"]

_NUM_NEW_TOKENS = pb.StepReport.DESCRIPTOR.fields_by_name["num_new_tokens"].number
_FINISH_REASONS = pb.StepReport.DESCRIPTOR.fields_by_name["finish_reasons"].number


def tasks_from_proto(msg: pb.Tasks) -> Tasks:
    """Core tasks from the message; ValueError if its columns disagree. Empty sections cost
    nothing (a decode step's Tasks usually carry only a few extensions)."""
    tasks = Tasks(
        seq=msg.seq, reset_prefix_cache=msg.reset_prefix_cache, report_step=msg.report_step
    )
    if msg.preempts:
        tasks.preempts = msg.preempts[:]
    if msg.aborts:
        tasks.aborts = msg.aborts[:]
    if msg.placements:
        tasks.placements = [convert.placement_from_proto(p) for p in msg.placements]
    ext, chk, snd = msg.extensions, msg.chunks, msg.kv_sends
    if ext.handles or ext.num_block_ids or ext.block_ids:
        handles = ext.handles[:]
        blocks = _split("extensions", handles, ext.num_block_ids, "block_ids", ext.block_ids)
        tasks.extensions = list(map(Extension, handles, blocks))
    if chk.handles or chk.starts or chk.num_tokens or chk.token_ids:
        handles, starts = chk.handles[:], chk.starts[:]
        _check_parallel("chunks", handles=handles, starts=starts)
        tokens = _split("chunks", handles, chk.num_tokens, "token_ids", chk.token_ids)
        tasks.chunks = list(map(Chunk, handles, starts, tokens))
    if snd.handles or snd.dst_instances or snd.dst_handles or snd.num_dst_block_ids:
        handles, dst, dst_handles = snd.handles[:], snd.dst_instances[:], snd.dst_handles[:]
        _check_parallel("kv_sends", handles=handles, dst_instances=dst, dst_handles=dst_handles)
        blocks = _split(
            "kv_sends", handles, snd.num_dst_block_ids, "dst_block_ids", snd.dst_block_ids
        )
        tasks.kv_sends = list(map(KvSend, handles, dst, dst_handles, blocks))
    return tasks


def _split(
    kind: str,
    handles: list[int],
    counts: RepeatedScalarFieldContainer[int],
    flat_name: str,
    flat: RepeatedScalarFieldContainer[int],
) -> list[list[int]]:
    """Cut `flat` into len(counts) consecutive lists of counts[i] items."""
    if len(counts) != len(handles):
        raise ValueError(f"{kind}: {len(handles)} handles but {len(counts)} counts of {flat_name}")
    total = sum(counts)
    if total != len(flat):
        raise ValueError(
            f"{kind}: counts add up to {total} {flat_name} but the message has {len(flat)}"
        )
    items = flat[:]
    out: list[list[int]] = []
    pos = 0
    for n in counts:
        out.append(items[pos : pos + n])
        pos += n
    return out


def _check_parallel(kind: str, **columns: Sequence[object]) -> None:
    lengths = {name: len(col) for name, col in columns.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"{kind}: parallel columns differ in length ({shown})")


def report_message(report: StepReport) -> pb.ConnectRequest:
    """The ConnectRequest carrying `report` (what convert.report_to_proto builds)."""
    msg = pb.ConnectRequest()
    r = msg.report
    r.step = report.step
    r.applied_seq = report.applied_seq
    r.step_time_ns = report.step_time_ns
    r.handles.extend(report.handles)
    r.num_computed.extend(report.num_computed)
    r.token_ids.extend(report.token_ids)
    _fill(r, _NUM_NEW_TOKENS, r.num_new_tokens, report.num_new_tokens)
    _fill(r, _FINISH_REASONS, r.finish_reasons, report.finish_reasons)  # type: ignore[arg-type]
    if report.acked:
        r.acked.extend(report.acked)
    if report.paused:
        r.paused.extend(report.paused)
    if report.failed:
        r.failed.extend(report.failed)
    return msg


def _fill(
    r: pb.StepReport, field: int, column: RepeatedScalarFieldContainer[int], values: list[int]
) -> None:
    """Append values to a packed varint column: as its wire bytes when all are one value
    below 128 (one byte each), else through extend."""
    n = len(values)
    if n and 0 <= values[0] < 128 and values.count(values[0]) == n:
        r.MergeFromString(bytes((field << 3 | 2,)) + _varint(n) + bytes((values[0],)) * n)
    else:
        column.extend(values)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
