"""n = 8 samples (GenerateRequest.sample_group) of a 1,000-token prompt sent at once to
`kvsched serve` with a `kvsched worker --executor sim`, as real processes: the worker's own
counter (its stats line, on SIGUSR1) shows the prompt computed once plus seven tails, and every
sample ends with max_tokens tokens."""

from __future__ import annotations

import asyncio
import re
import signal

import grpc

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.harness import start_daemon, start_worker, status, wait_ready

N, PROMPT_LEN, MAX_TOKENS = 8, 1000, 8


async def _generate_all(address: str, reqs: list[rpb.GenerateRequest]) -> list[rpb.Finished]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)

        async def one(req: rpb.GenerateRequest) -> rpb.Finished:
            async for r in stub.Generate(req, timeout=60):
                if r.WhichOneof("kind") == "finished":
                    return r.finished
            raise AssertionError(f"{req.request_id}: no Finished")

        return list(await asyncio.gather(*(one(r) for r in reqs)))


def test_sim_worker_computes_the_prompt_of_eight_samples_once() -> None:
    daemon, address = start_daemon()
    worker = start_worker(address, "i0")
    try:
        wait_ready(address, ["i0"])
        bs = status(address, "i0").instances[0].block_size
        prompt = [(7 * i) % 500 + 2 for i in range(PROMPT_LEN)]
        reqs = [
            rpb.GenerateRequest(
                request_id=f"s{i}",
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                sample_group="eight",
            )
            for i in range(N)
        ]
        finished = asyncio.run(asyncio.wait_for(_generate_all(address, reqs), 90))
        assert all(f.usage.output_tokens == MAX_TOKENS for f in finished)
        full = (PROMPT_LEN - 1) // bs * bs
        assert sorted(f.usage.cached_tokens for f in finished) == [0] + [full] * (N - 1)
        mark = len(worker.lines)
        worker.signal(signal.SIGUSR1)
        line = worker.wait_after(worker.lines[mark - 1], r"worker stats: .*")
        computed = int(re.search(r"(\d+) prompt tokens computed", line.group(0)).group(1))  # type: ignore[union-attr]
        assert computed == PROMPT_LEN + (N - 1) * (PROMPT_LEN - full)
    finally:
        worker.stop()
        daemon.stop()
