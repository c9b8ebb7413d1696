"""Test-side gRPC clients and the expected outputs of the sim worker."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.sim import SimExecutor

SIM = SimExecutor(seed=0)  # the worker's default: tokens are a function of (request id, position)


def expected_tokens(req_id: str, prompt_len: int, max_tokens: int, stop: list[int]) -> list[int]:
    out = []
    for i in range(max_tokens):
        t = SIM.token_at(req_id, prompt_len + i)
        out.append(t)
        if t in stop:
            break
    return out


@dataclass
class Spec:
    req_id: str
    prompt: list[int]
    max_tokens: int
    stop: list[int] = field(default_factory=list)

    def message(self, detachable: bool = False) -> rpb.GenerateRequest:
        return rpb.GenerateRequest(
            request_id=self.req_id,
            prompt_token_ids=self.prompt,
            sampling=common_pb2.SamplingParams(
                max_tokens=self.max_tokens, stop_token_ids=self.stop, ignore_eos=True
            ),
            detachable=detachable,
        )

    @property
    def expected(self) -> list[int]:
        return expected_tokens(self.req_id, len(self.prompt), self.max_tokens, self.stop)


def mixed_specs(n: int, seed: int = 0, prefix_len: int = 256) -> list[Spec]:
    """Mixed lengths, a few shared prefixes, some requests that hit a stop token early."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(prefix_len)] for _ in range(4)]
    specs = []
    for i in range(n):
        rid = f"s{seed}-{i}"
        tail = [rng.randrange(3, 30000) for _ in range(rng.randrange(1, 200))]
        prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + tail
        max_tokens = rng.randrange(1, 48)
        stop: list[int] = []
        if rng.random() < 0.2 and max_tokens > 4:  # stop at a token the model will produce
            stop = [expected_tokens(rid, len(prompt), max_tokens, [])[rng.randrange(max_tokens)]]
        specs.append(Spec(rid, prompt, max_tokens, stop))
    return specs


@dataclass
class Outcome:
    req_id: str = ""
    instance: str = ""
    tokens: list[int] = field(default_factory=list)
    finished: rpb.Finished | None = None
    code: grpc.StatusCode | None = None
    details: str = ""


async def generate(
    stub: request_service_pb2_grpc.RequestServiceStub,
    msg: rpb.GenerateRequest,
    metadata: tuple[tuple[str, str], ...] = (),
    queued: asyncio.Event | None = None,
    timeout: float | None = None,
) -> Outcome:
    out = Outcome()
    try:
        async for r in stub.Generate(msg, metadata=metadata, timeout=timeout):
            kind = r.WhichOneof("kind")
            if kind == "queued":
                out.req_id, out.instance = r.queued.request_id, r.queued.instance
                if queued is not None:
                    queued.set()
            elif kind == "tokens":
                out.tokens.extend(r.tokens.token_ids)
            else:
                assert out.finished is None, "two finished messages"
                out.finished = r.finished
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code(), exc.details() or ""
    return out


def run(coro):
    return asyncio.run(coro)
