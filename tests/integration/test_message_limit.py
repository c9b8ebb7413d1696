"""The daemon's receive limit is derived from max_model_len by default: a request far larger
than any valid one is refused by gRPC before the daemon holds it (RESOURCE_EXHAUSTED naming the
sizes), each refusal costs no lasting memory, and the daemon serves on."""

from __future__ import annotations

import grpc

from bench.refusal_rss import TOKEN, rss_kib
from kvsched.client import Client
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.harness import start_daemon, start_worker, wait_ready


def _payload(num_tokens: int) -> bytes:
    msg = rpb.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4))
    msg.prompt_token_ids.extend([TOKEN] * num_tokens)
    return msg.SerializeToString()


def test_oversized_requests_are_refused_before_the_daemon_holds_them() -> None:
    daemon, address = start_daemon()
    worker = start_worker(address, "i0", "--zero-cost")
    try:
        wait_ready(address, ["i0"])
        with Client(address, timeout=30) as c:
            assert len(c.generate([1, 2, 3], max_tokens=4).tokens()) == 4
        before, _ = rss_kib(daemon.popen.pid)
        big = _payload(15_000_000)  # 60 MB: 1 << 21 takes 4 bytes as a varint
        limit = 6 * 131072 + (1 << 20)  # the derived default for max_model_len 131072
        with grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 128 << 20)]
        ) as ch:
            call = ch.unary_stream(
                "/kvsched.v1.RequestService/Generate",
                request_serializer=lambda b: b,
                response_deserializer=rpb.GenerateResponse.FromString,
            )
            for _ in range(10):
                try:
                    list(call(big, timeout=60))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert f"{len(big)} vs. {limit}" in exc.details()
                else:
                    raise AssertionError("a 60 MB request was accepted")
        after, _ = rss_kib(daemon.popen.pid)
        assert (after - before) < 100 * 1024, (before, after)  # KiB: goal < 100 MB per 100
        with Client(address, timeout=30) as c:
            assert len(c.generate([1, 2, 3], max_tokens=4).tokens()) == 4
    finally:
        worker.stop()
        daemon.stop()
