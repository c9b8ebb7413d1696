"""Three daemons, six sim workers, one NATS: any daemon takes any request, requests follow their
cached prefix across daemons, outputs are relayed exactly once with the right tokens, aborts and
dropped clients work through any daemon, and every KV block is free at the end."""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from kvsched.cluster.natsd import NatsServer
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.conftest import start_cluster
from tests.integration.clients import Outcome, Spec, generate
from tests.integration.harness import status, wait_pool_free

PREFIX_LEN = 256  # 16 blocks of 16 tokens
NUM_GROUPS = 10  # not a multiple of 3: a group arrives through every daemon


def _specs(n: int, seed: int) -> tuple[list[list[int]], list[tuple[int, Spec]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(PREFIX_LEN)] for _ in range(NUM_GROUPS)]
    out = []
    for i in range(n):
        g = i % NUM_GROUPS
        tail = [rng.randrange(3, 30000) for _ in range(rng.randrange(4, 40))]
        out.append((g, Spec(f"cr{seed}-{i}", prefixes[g] + tail, rng.randrange(2, 8))))
    return prefixes, out


def test_thousand_requests_round_robin_over_three_daemons(nats_server: NatsServer) -> None:
    cluster = start_cluster(nats_server.url, "cr", 3, 2)
    try:
        addrs = cluster.addresses

        async def go() -> tuple[list[tuple[int, Spec, Outcome]], float]:
            channels = [grpc.aio.insecure_channel(a) for a in addrs]
            stubs = [request_service_pb2_grpc.RequestServiceStub(ch) for ch in channels]
            prefixes, specs = _specs(1000, 1)
            # Warm each prefix once (through daemon g % 3), so some instance holds it.
            warm = [Spec(f"warm-{g}", p + [7, 8, 9], 2) for g, p in enumerate(prefixes)]
            for g, s in enumerate(warm):
                o = await generate(stubs[g % 3], s.message(), timeout=30)
                assert o.finished is not None and o.tokens == s.expected, o
            await asyncio.sleep(0.5)  # the KV events of the warm-up reach every daemon
            sem = asyncio.Semaphore(48)
            results: list[tuple[int, Spec, Outcome]] = []

            async def one(k: int, g: int, s: Spec) -> None:
                async with sem:
                    o = await generate(stubs[k % 3], s.message(), timeout=60)
                results.append((g, s, o))

            t0 = time.monotonic()
            await asyncio.gather(*(one(k, g, s) for k, (g, s) in enumerate(specs)))
            took = time.monotonic() - t0
            for ch in channels:
                await ch.close()
            return results, took

        results, took = asyncio.run(go())
        assert len(results) == 1000
        holding = 0
        for _g, s, o in results:
            assert o.code is None, (s.req_id, o.code, o.details)
            assert o.finished is not None, s.req_id
            assert o.finished.reason == common_pb2.FINISH_REASON_LENGTH, o.finished
            assert o.tokens == s.expected, s.req_id
            assert o.finished.usage.output_tokens == len(s.expected)
            # Followed its prefix: the instance it ran on had the shared prefix cached.
            if o.finished.usage.cached_tokens >= PREFIX_LEN - 16:
                holding += 1
        share = holding / len(results)
        forwarded = sum(status(a).cluster.num_forwarded for a in addrs)
        print(
            f"\n1000 requests over 3 daemons in {took:.1f} s; prefix-following share "
            f"{share:.3f}; forwarded {forwarded}"
        )
        assert share >= 0.90, share
        assert forwarded > 0, "no request crossed daemons: the test did not exercise forwarding"
        for a in addrs:
            wait_pool_free(a, timeout=20)
    finally:
        cluster.stop()


def test_aborts_and_dropped_clients_through_any_daemon(nats_server: NatsServer) -> None:
    # Slow sim steps: long requests are still running when they are aborted.
    cluster = start_cluster(nats_server.url, "ab", 3, 1, worker_args=("--speed", "0.5"))
    try:
        addrs = cluster.addresses

        rng = random.Random(7)
        prefixes = [[rng.randrange(3, 30000) for _ in range(128)] for _ in range(3)]

        def long_msg(rid: str, k: int) -> rpb.GenerateRequest:
            return rpb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=[*prefixes[k % 3], *range(100 + k, 108 + k)],
                sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
            )

        async def go() -> None:
            channels = [grpc.aio.insecure_channel(a) for a in addrs]
            stubs = [request_service_pb2_grpc.RequestServiceStub(ch) for ch in channels]
            # Warm prefix j through daemon j: some instance holds each prefix from now on.
            for j in range(3):
                s = Spec(f"ab-warm-{j}", [*prefixes[j], 1, 2], 2)
                o = await generate(stubs[j], s.message(), timeout=30)
                assert o.tokens == s.expected
            await asyncio.sleep(0.5)  # their KV events reach every daemon
            cases = []
            for k in range(9):  # prefix (k+1) % 3 through daemon k % 3: it follows its prefix
                rid = f"ab-{k}"
                queued = asyncio.Event()
                task = asyncio.create_task(
                    generate(stubs[k % 3], long_msg(rid, k + 1), queued=queued, timeout=60)
                )
                await asyncio.wait_for(queued.wait(), 20)
                cases.append((rid, task, (k // 3 + k) % 3))
            await asyncio.sleep(0.5)
            for rid, _task, via in cases:
                await stubs[via].Abort(rpb.AbortRequest(request_id=rid), timeout=10)
            outs = [await asyncio.wait_for(t, 30) for _, t, _ in cases]
            ran_elsewhere = [k for k, o in enumerate(outs) if o.instance != f"ab{k % 3}"]
            # (a request keeps its queued instance: forwarded ones name the peer's)
            assert ran_elsewhere, "no request was forwarded: the test did not exercise relaying"
            for (rid, _, via), o in zip(cases, outs, strict=True):
                assert o.finished is not None, (rid, o.code, o.details)
                assert o.finished.reason == common_pb2.FINISH_REASON_ABORT, (rid, via, o.finished)
                assert len(o.tokens) < 2000
            # An id nobody tracks is NOT_FOUND through any daemon.
            try:
                await stubs[1].Abort(rpb.AbortRequest(request_id="nobody"), timeout=10)
                raise AssertionError("abort of an unknown id succeeded")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
            # Dropped clients: cancel the calls; the requests end wherever they ran.
            tasks = [
                asyncio.create_task(
                    generate(stubs[k % 3], long_msg(f"drop-{k}", k + 1), timeout=60)
                )
                for k in range(6)
            ]
            await asyncio.sleep(1.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ch in channels:
                await ch.close()

        asyncio.run(go())
        for a in addrs:
            st = wait_pool_free(a, timeout=20)
            assert st.num_running == 0 and st.num_waiting == 0
    finally:
        cluster.stop()
