"""Round trips and shape checks of kvsched.codec (core <-> kvsched.v1 protobuf)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np
import pytest

from kvsched import codec
from kvsched.core import protocol as core
from kvsched.core.config import Role
from kvsched.v1 import common_pb2, request_service_pb2, worker_service_pb2
from tests.reports import listed


def make_sampling(seed: int = 7) -> core.SamplingParams:
    return core.SamplingParams(
        max_tokens=128,
        min_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=seed,
        stop_token_ids=[2, 13],
        ignore_eos=True,
    )


def make_tasks() -> core.Tasks:
    """A Tasks message with every field populated, including empty and -1 corner values."""
    return core.Tasks(
        seq=42,
        preempts=[3, 5],
        aborts=[8],
        placements=[
            core.Placement(
                handle=11,
                slot=0,
                req_id="req-a",
                block_ids=[4, 9, 1],
                num_cached_tokens=32,
                num_prefill_tokens=40,
                num_output_tokens=0,
                last_token_id=-1,
                sampling=make_sampling(),
                lora_name="adapter-1",
            ),
            core.Placement(
                handle=12,
                slot=3,
                req_id="req-b",
                block_ids=[],
                num_cached_tokens=17,
                num_prefill_tokens=17,
                num_output_tokens=5,
                last_token_id=99,
                sampling=core.SamplingParams(),
            ),
        ],
        extensions=[
            core.Extension(handle=6, block_ids=[20, 21]),
            core.Extension(handle=7, block_ids=[]),
            core.Extension(handle=9, block_ids=[22]),
        ],
        chunks=[
            core.Chunk(handle=11, start=32, token_ids=[1, 2, 3, 4, 5, 6, 7, 8]),
            core.Chunk(handle=13, start=512, token_ids=[0]),
        ],
        kv_sends=[
            core.KvSend(handle=11, dst_instance="decode-0", dst_handle=70, dst_block_ids=[5, 6]),
            core.KvSend(handle=13, dst_instance="decode-1", dst_handle=71, dst_block_ids=[]),
        ],
        reset_prefix_cache=True,
    )


def make_report() -> core.StepReport:
    return core.StepReport(
        step=1000,
        applied_seq=41,
        handles=[11, 12, 13, 14],
        num_computed=[40, 18, 520, 77],
        num_new_tokens=[1, 3, 0, 1],
        token_ids=[101, 102, 103, 104, 105],
        finish_reasons=[
            core.FinishReason.NONE,
            core.FinishReason.STOP,
            core.FinishReason.NONE,
            core.FinishReason.LENGTH,
        ],
        acked=[3, 5, 8],
        paused=[6],
        failed=[14],
        step_time_ns=12_345_678,
    )


def test_generated_code_importable_via_package() -> None:
    for name in ("common", "request_service", "worker_service", "admin_service"):
        module = importlib.import_module(f"kvsched.v1.{name}_pb2")
        assert module.DESCRIPTOR.package == "kvsched.v1"
    grpc_module = importlib.import_module("kvsched.v1.worker_service_pb2_grpc")
    assert hasattr(grpc_module, "WorkerServiceStub")
    assert hasattr(grpc_module, "add_WorkerServiceServicer_to_server")


def test_tasks_round_trip_through_bytes() -> None:
    tasks = make_tasks()
    data = codec.tasks_to_proto(tasks).SerializeToString()
    assert codec.tasks_from_proto(worker_service_pb2.Tasks.FromString(data)) == tasks


def test_tasks_to_bytes_is_a_connect_response() -> None:
    tasks = make_tasks()
    response = worker_service_pb2.ConnectResponse.FromString(codec.tasks_to_bytes(tasks))
    assert response.WhichOneof("kind") == "tasks"
    assert codec.tasks_from_proto(response.tasks) == tasks


def test_empty_tasks_round_trip() -> None:
    tasks = core.Tasks(seq=1)
    response = worker_service_pb2.ConnectResponse.FromString(codec.tasks_to_bytes(tasks))
    assert response.WhichOneof("kind") == "tasks"
    assert codec.tasks_from_proto(response.tasks) == tasks


def test_tasks_are_columnar() -> None:
    pb = codec.tasks_to_proto(make_tasks())
    assert list(pb.extensions.num_block_ids) == [2, 0, 1]
    assert list(pb.extensions.block_ids) == [20, 21, 22]
    assert list(pb.chunks.starts) == [32, 512]
    assert list(pb.chunks.num_tokens) == [8, 1]


def test_report_round_trip_through_bytes() -> None:
    report = make_report()
    data = codec.report_to_proto(report).SerializeToString()
    back = codec.report_from_proto(worker_service_pb2.StepReport.FromString(data))
    assert listed(back) == report
    # The per-row columns arrive as int64 arrays (finish reasons too: the core checks "none
    # finished" on the array): the core's decode path is vectorized.
    assert back.handles.dtype == back.token_ids.dtype == np.int64  # type: ignore[union-attr]
    assert back.finish_reasons.dtype == np.int64  # type: ignore[union-attr]


def test_empty_report_round_trip() -> None:
    report = core.StepReport(step=1, applied_seq=0)
    data = codec.report_to_proto(report).SerializeToString()
    back = codec.report_from_proto(worker_service_pb2.StepReport.FromString(data))
    assert listed(back) == report


@pytest.mark.parametrize(
    ("column", "match"),
    [
        ("num_computed", "parallel columns differ"),
        ("num_new_tokens", "parallel columns differ"),
        ("finish_reasons", "parallel columns differ"),
        ("token_ids", "num_new_tokens add up to 5 but the report has 6 token_ids"),
    ],
)
def test_report_column_lengths_checked(column: str, match: str) -> None:
    pb = codec.report_to_proto(make_report())
    getattr(pb, column).append(0)
    with pytest.raises(ValueError, match=match):
        codec.report_from_proto(pb)


def test_report_unknown_finish_reason_rejected() -> None:
    pb = codec.report_to_proto(make_report())
    pb.finish_reasons[0] = common_pb2.FinishReason.ValueType(9)  # open enum: survives parsing
    with pytest.raises(ValueError, match=r"unknown finish reasons \[9\]"):
        codec.report_from_proto(worker_service_pb2.StepReport.FromString(pb.SerializeToString()))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda pb: pb.extensions.handles.append(1), "extensions: 4 handles but 3 counts"),
        (lambda pb: pb.extensions.block_ids.append(1), "extensions: counts add up to 3"),
        (lambda pb: pb.chunks.starts.append(1), r"chunks: parallel columns .*starts=3"),
        (lambda pb: pb.chunks.num_tokens.append(0), "chunks: 2 handles but 3 counts"),
        (lambda pb: pb.chunks.token_ids.pop(), "chunks: counts add up to 9 token_ids"),
        (lambda pb: pb.kv_sends.dst_instances.pop(), "kv_sends: parallel columns"),
        (lambda pb: pb.kv_sends.dst_block_ids.append(3), "kv_sends: counts add up to 2"),
    ],
)
def test_tasks_column_lengths_checked(
    mutate: Callable[[worker_service_pb2.Tasks], object], match: str
) -> None:
    pb = codec.tasks_to_proto(make_tasks())
    mutate(pb)
    with pytest.raises(ValueError, match=match):
        codec.tasks_from_proto(pb)


def test_sampling_round_trip() -> None:
    params = make_sampling()
    data = codec.sampling_to_proto(params).SerializeToString()
    assert codec.sampling_from_proto(common_pb2.SamplingParams.FromString(data)) == params


def test_sampling_absent_fields_take_defaults() -> None:
    params = codec.sampling_from_proto(common_pb2.SamplingParams())
    assert params == core.SamplingParams()
    assert params.top_p == 1.0
    assert codec.sampling_from_proto(common_pb2.SamplingParams(), 256).max_tokens == 256
    explicit = common_pb2.SamplingParams(max_tokens=0, top_p=0.5)
    assert codec.sampling_from_proto(explicit, 256).max_tokens == 0
    assert codec.sampling_from_proto(explicit).top_p == 0.5


def test_mm_ranges_round_trip() -> None:
    ranges = [core.MultimodalRange(5, 576, "sha256:ab"), core.MultimodalRange(600, 64, "cd")]
    request = request_service_pb2.GenerateRequest(mm_ranges=codec.mm_ranges_to_proto(ranges))
    parsed = request_service_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert codec.mm_ranges_from_proto(parsed.mm_ranges) == ranges


def test_finish_reason_values_match_proto_enum() -> None:
    for reason in core.FinishReason:
        proto_name = "FINISH_REASON_" + ("UNSPECIFIED" if reason.name == "NONE" else reason.name)
        assert common_pb2.FinishReason.Value(proto_name) == int(reason)
        assert codec.finish_reason_to_proto(reason) == int(reason)
        assert codec.finish_reason_from_proto(int(reason)) is reason
    assert len(common_pb2.FinishReason.keys()) == len(core.FinishReason)
    with pytest.raises(ValueError, match="unknown FinishReason 5"):
        codec.finish_reason_from_proto(5)


def test_role_round_trip() -> None:
    for role in Role:
        assert codec.role_from_proto(codec.role_to_proto(role)) is role
    with pytest.raises(ValueError, match="InstanceRole 0"):
        codec.role_from_proto(common_pb2.INSTANCE_ROLE_UNSPECIFIED)


def test_an_empty_finish_reasons_column_means_none_finished() -> None:
    # A worker may leave the column out on a step where nothing finished (the core's
    # StepReport says the same); any other length is refused.
    pb = codec.report_to_proto(make_report())
    del pb.finish_reasons[:]
    back = codec.report_from_proto(pb)
    assert len(back.finish_reasons) == 0 and len(back.handles) > 0
