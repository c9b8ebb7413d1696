"""Conversion between the core's protocol dataclasses and the kvsched.v1 protobuf messages, one
implementation shared by the daemon and the worker.

It imports `kvsched.core` and `kvsched.v1` and nothing else of kvsched: the server and the
worker stub sit above it (they, cluster/ and durability/ import both too, for their own
messages). One module per proto file:

    common    common.proto: finish reasons, roles, sampling parameters, multimodal ranges
    worker    worker_service.proto: Tasks, StepReport, placements (the hot path, both sides)
    requests  request_service.proto: GenerateRequest in, Finished out (the front end)

The worker protocol's rules are in the WorkerService comment of
`protos/kvsched/v1/worker_service.proto`.
"""

from kvsched.codec.common import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    mm_ranges_from_proto,
    mm_ranges_to_proto,
    role_from_proto,
    role_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from kvsched.codec.requests import finished_to_proto, request_from_proto
from kvsched.codec.worker import (
    PROTOCOL_VERSION,
    merge_reports,
    placement_from_proto,
    placement_to_proto,
    report_from_proto,
    report_message,
    report_to_proto,
    tasks_from_proto,
    tasks_to_bytes,
    tasks_to_proto,
)

__all__ = [
    "PROTOCOL_VERSION",
    "finish_reason_from_proto",
    "finish_reason_to_proto",
    "finished_to_proto",
    "merge_reports",
    "mm_ranges_from_proto",
    "mm_ranges_to_proto",
    "placement_from_proto",
    "placement_to_proto",
    "report_from_proto",
    "report_message",
    "report_to_proto",
    "request_from_proto",
    "role_from_proto",
    "role_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "tasks_from_proto",
    "tasks_to_bytes",
    "tasks_to_proto",
]
