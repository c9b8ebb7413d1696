"""The storage tier with every part its own process: `kvsched serve --storage URL`, `kvsched
worker --executor model` processes and a real Mooncake Store (master + segment holder). One
worker computes a prefix and writes its blocks (write_through); it exits; a worker of another
instance fetches them from the store. Tokens equal `generate_reference` (the model, unpaged)."""

from __future__ import annotations

import time

import grpc
import numpy as np

from kvsched.storage.server import MooncakeServer
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.model import ModelConfig, generate_reference
from tests.integration.harness import start_daemon, start_worker, status, wait_ready
from tests.storage.conftest import mooncake  # noqa: F401 (fixture)

BS = 16
MODEL = ("--executor", "model", "--num-blocks", "64", "--block-size", str(BS))


def _generate(
    address: str, req_id: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], str]:
    with grpc.insecure_channel(address) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)
        msg = rpb.GenerateRequest(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        tokens, instance, finished = [], "", False
        for r in stub.Generate(msg, timeout=60):
            kind = r.WhichOneof("kind")
            if kind == "queued":
                instance = r.queued.instance
            elif kind == "tokens":
                tokens.extend(r.tokens.token_ids)
            elif kind == "finished":
                finished = True
        assert finished, f"{req_id}: no Finished"
        return tokens, instance


def _wait(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_model_workers_share_a_prefix_through_the_store(mooncake: MooncakeServer) -> None:  # noqa: F811
    config = ModelConfig()
    rng = np.random.default_rng(2901)
    prefix = rng.integers(2, config.vocab_size, size=4 * BS).tolist()
    first = prefix + rng.integers(2, config.vocab_size, size=3).tolist()
    second = prefix + rng.integers(2, config.vocab_size, size=9).tolist()
    daemon, address = start_daemon(
        "--storage", mooncake.url, "--storage-write-policy", "write_through"
    )
    w0 = start_worker(address, "i0", *MODEL)
    w1 = None
    try:
        wait_ready(address, ["i0"])
        tokens, where = _generate(address, "w", first, 6)
        assert where == "i0" and tokens == generate_reference(config, first, 6)
        _wait(
            lambda: status(address, "i0").instances[0].num_storage_writes >= 4,
            "i0's prefix blocks written",
        )
        # The count grows when the writes are sent; the worker applies tasks in order and
        # writes inside its step, so a later request finishing on i0 means they are stored.
        _generate(address, "flush", [2, 3, 4], 1)
        w0.stop()
        w1 = start_worker(address, "i1", *MODEL)
        wait_ready(address, ["i1"])
        tokens, where = _generate(address, "f", second, 8)
        assert where == "i1" and tokens == generate_reference(config, second, 8)
        st = status(address, "i1").instances[0]
        assert st.prefix_cache_storage_hit_tokens == 4 * BS and st.num_storage_fetches == 4, st
        assert st.num_storage_failures == 0
    finally:
        for p in (w0, w1, daemon):
            if p is not None:
                p.stop()
