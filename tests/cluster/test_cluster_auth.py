"""Forwarding between daemons that require tokens: the cluster token authenticates the peer
call, the client's identity travels with it (so the client can abort through either daemon),
and a client cannot forge that identity."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc

from kvsched.cluster.natsd import NatsServer
from kvsched.server.auth import principal_of
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import Spec, generate
from tests.integration.harness import Proc, start_daemon, start_worker

C1 = "client-one-0123456789abcdef"
C2 = "client-two-0123456789abcdef"
WORKER = "worker-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
CLUSTER = "cluster-token-0123456789abcdef"


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _status(addr: str) -> apb.GetStatusResponse:
    with grpc.insecure_channel(addr) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        return stub.GetStatus(apb.GetStatusRequest(), metadata=_md(ADMIN), timeout=5)


def test_forwarding_with_tokens_keeps_the_clients_identity(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    auth = tmp_path / "auth"
    auth.write_text(f"client {C1}\nclient {C2}\nworker {WORKER}\nadmin {ADMIN}\nclient {CLUSTER}\n")
    procs: list[Proc] = []
    try:
        addrs = []
        for k in range(2):
            p, a = start_daemon(
                "--cluster", nats_server.url, "--daemon-id", f"au-d{k}", "--auth-file",
                str(auth), "--cluster-token", CLUSTER,
            )  # fmt: skip
            procs.append(p)
            addrs.append(a)
        for k in range(2):
            procs.append(start_worker(addrs[k], f"au{k}", "--speed", "0.5", "--token", WORKER))
        deadline = time.monotonic() + 30
        while True:
            known = [
                {i.instance_id for i in _status(a).cluster.instances if i.load_known} for a in addrs
            ]
            if all(k == {"au0", "au1"} for k in known):
                break
            assert time.monotonic() < deadline, known
            time.sleep(0.1)
        rng = random.Random(5)
        prefix = [rng.randrange(3, 30000) for _ in range(128)]

        def long(rid: str) -> rpb.GenerateRequest:
            return rpb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=[*prefix, 9, 9],
                sampling=common_pb2.SamplingParams(max_tokens=3000, ignore_eos=True),
            )

        async def go() -> None:
            ch = [grpc.aio.insecure_channel(a) for a in addrs]
            stubs = [request_service_pb2_grpc.RequestServiceStub(c) for c in ch]
            warm = Spec("au-warm", [*prefix, 1], 2)
            o = await generate(stubs[0], warm.message(), _md(C1), timeout=30)
            assert o.tokens == warm.expected and o.instance == "au0", o
            await asyncio.sleep(0.5)  # d1 learns that au0 holds the prefix
            # Through d1, the request follows its prefix to au0 on d0: forwarded with the
            # cluster token; the peer tracks it as C1's.
            queued = asyncio.Event()
            task = asyncio.create_task(
                generate(stubs[1], long("au-r1"), _md(C1), queued=queued, timeout=60)
            )
            await asyncio.wait_for(queued.wait(), 20)
            await asyncio.sleep(0.3)
            for stub in stubs:  # another client may not abort it, through either daemon
                try:
                    await stub.Abort(rpb.AbortRequest(request_id="au-r1"), metadata=_md(C2))
                    raise AssertionError("C2 aborted C1's request")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            # C1 aborts it through the peer (d0), which runs it.
            await stubs[0].Abort(rpb.AbortRequest(request_id="au-r1"), metadata=_md(C1))
            out = await asyncio.wait_for(task, 30)
            assert out.instance == "au0", out.instance  # it was forwarded
            assert (
                out.finished is not None and out.finished.reason == common_pb2.FINISH_REASON_ABORT
            )
            # It ran on the peer (the forwarded call was let in) and ended by C1's abort.
            assert out.tokens and out.finished.message == "aborted by client", out.finished
            assert out.tokens == Spec("au-r1", [*prefix, 9, 9], 3000).expected[: len(out.tokens)]
            # A client forging the forwarding metadata keeps its own identity.
            forged = (
                *_md(C1),
                ("x-kvsched-forwarded-by", "au-d1"),
                ("x-kvsched-instance", "au0"),
                ("x-kvsched-owner", principal_of(C2)),
            )
            queued = asyncio.Event()
            task = asyncio.create_task(
                generate(stubs[0], long("au-r2"), forged, queued=queued, timeout=60)
            )
            await asyncio.wait_for(queued.wait(), 20)
            try:
                await stubs[0].Abort(rpb.AbortRequest(request_id="au-r2"), metadata=_md(C2))
                raise AssertionError("the forged owner was believed")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            await stubs[0].Abort(rpb.AbortRequest(request_id="au-r2"), metadata=_md(C1))
            out = await asyncio.wait_for(task, 30)
            assert (
                out.finished is not None and out.finished.reason == common_pb2.FINISH_REASON_ABORT
            )
            # Nor can it pose as a peer's P/D hand-off (tokens "prefilled" for it).
            handed = long("au-r3")
            handed.prefilled_token_ids.extend([5])
            out = await generate(stubs[0], handed, forged, timeout=30)
            assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
            assert "prefilled_token_ids" in out.details and not out.tokens, out
            for c in ch:
                await c.close()

        asyncio.run(go())
    finally:
        for p in reversed(procs):
            p.stop()
