"""Messages of `request_service.proto` the front end needs: a GenerateRequest in, a Finished
out."""

from __future__ import annotations

import numpy as np

from kvsched.codec.common import finish_reason_to_proto, mm_ranges_from_proto, sampling_from_proto
from kvsched.core.request import Request
from kvsched.v1 import common_pb2, request_service_pb2


def request_from_proto(
    pb: request_service_pb2.GenerateRequest,
    req_id: str,
    arrival_time: float,
    default_max_tokens: int | None = None,
) -> Request:
    """A core request from a GenerateRequest; an absent max_tokens takes `default_max_tokens`
    (None: the core's default). Field ranges are checked by the scheduler."""
    # The prompt packed once (int32, as the message holds it; a C copy), then a list from the
    # array (cheaper than from the message): the core keeps both (Request.prompt_array).
    ids = np.array(pb.prompt_token_ids, dtype=np.int32)
    return Request(
        req_id=req_id,
        prompt_token_ids=ids.tolist(),
        prompt_array=ids,
        sampling=sampling_from_proto(pb.sampling, default_max_tokens),
        priority=pb.priority,
        arrival_time=arrival_time,
        lora_name=pb.lora_name,
        cache_salt=pb.cache_salt,
        mm_ranges=mm_ranges_from_proto(pb.mm_ranges),
        ttft_deadline_ms=float(pb.ttft_deadline_ms),
        tenant=pb.tenant,
        sample_group=pb.sample_group,
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
