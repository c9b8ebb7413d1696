"""The worker client against a scripted in-test WorkerService (a fake daemon) over loopback.

Each test starts a grpc.aio server on 127.0.0.1:0 whose Connect handler runs a script per stream
(read hello, send welcome and tasks, collect reports), runs real `Worker`s against it in the same
event loop, and checks what crossed the wire. Waits are on events and queues with timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import grpc
import pytest

from kvsched import codec
from kvsched.core.protocol import (
    Chunk,
    FinishReason,
    KvSend,
    Placement,
    SamplingParams,
    StepReport,
    Tasks,
)
from kvsched.v1 import kv_transfer_service_pb2 as kv_pb2
from kvsched.v1 import kv_transfer_service_pb2_grpc as kv_grpc
from kvsched.v1 import worker_service_pb2 as pb
from kvsched.v1 import worker_service_pb2_grpc as pb_grpc
from kvsched.worker_stub.client import (
    Worker,
    WorkerError,
    model_engine_factory,
    sim_engine_factory,
)
from kvsched.worker_stub.sim import SimExecutor
from tests.reports import listed

BLOCK = 4
TIMEOUT = 5.0
PROMPT = [11, 12, 13, 14, 15, 16]


class Conn:
    """One worker's Connect stream, as the fake daemon sees it."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.hello: pb.Hello | None = None
        self.kinds: list[str] = []
        self.reports: asyncio.Queue[StepReport] = asyncio.Queue()
        self.num_heartbeats = 0
        self.heartbeat = asyncio.Event()
        self._hello = asyncio.Event()

    async def read(self, requests: AsyncIterator[pb.ConnectRequest]) -> None:
        async for msg in requests:
            kind = msg.WhichOneof("kind")
            self.kinds.append(kind)
            if kind == "hello":
                self.hello = msg.hello
                self._hello.set()
            elif kind == "report":
                self.reports.put_nowait(listed(codec.report_from_proto(msg.report)))
            elif kind == "heartbeat":
                self.num_heartbeats += 1
                self.heartbeat.set()

    async def wait_hello(self) -> pb.Hello:
        await asyncio.wait_for(self._hello.wait(), TIMEOUT)
        assert self.hello is not None
        return self.hello

    async def welcome(self, heartbeat_s: float = 1.0, answers_reports: bool = False) -> None:
        await self.send(
            welcome=pb.Welcome(
                protocol_version=codec.PROTOCOL_VERSION,
                block_size=BLOCK,
                max_model_len=256,
                heartbeat_interval_ns=int(heartbeat_s * 1e9),
                answers_reports=answers_reports,
            )
        )

    async def send(self, **kind: Any) -> None:
        await self.context.write(pb.ConnectResponse(**kind))

    async def send_tasks(self, tasks: Tasks) -> None:
        await self.send(tasks=codec.tasks_to_proto(tasks))

    async def next_report(self) -> StepReport:
        return await asyncio.wait_for(self.reports.get(), TIMEOUT)

    async def tokens_until_finished(self, handle: int) -> tuple[list[int], FinishReason]:
        """Tokens reported for `handle` until a report finishes it."""
        tokens: list[int] = []
        while True:
            report = await self.next_report()
            pos = 0
            for h, n, reason in zip(
                report.handles, report.num_new_tokens, report.finish_reasons, strict=True
            ):
                if h == handle:
                    tokens += report.token_ids[pos : pos + n]
                    if reason:
                        return tokens, FinishReason(reason)
                pos += n


Script = Callable[[Conn], Awaitable[None]]


class FakeDaemon(pb_grpc.WorkerServiceServicer):
    """Runs `script` on every Connect stream; the stream ends with OK when the script returns.
    A failing script stops every worker in `workers` and is re-raised by `run`.

    Scripts keep the worker's heartbeat interval well above the time the stream takes to end:
    a heartbeat written while the server finishes the call races grpc's own status (the client
    may then see INTERNAL "Internal error from Core" instead of OK and reconnect), which made
    tests with a 20 ms interval fail now and then on a loaded machine."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.workers: list[Worker] = []
        self.errors: list[BaseException] = []
        self.address = ""

    async def Connect(
        self, request_iterator: AsyncIterator[pb.ConnectRequest], context: grpc.aio.ServicerContext
    ) -> None:
        conn = Conn(context)
        reader = asyncio.create_task(conn.read(request_iterator))
        try:
            await self.script(conn)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            self.errors.append(e)
            for worker in self.workers:
                worker.stop()
            raise
        finally:
            reader.cancel()

    async def run(self, *workers: Worker, timeout: float = 10.0) -> None:
        """Run the workers until they return; raise the first script failure."""
        self.workers.extend(workers)
        await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), timeout)
        if self.errors:
            raise self.errors[0]


def run_test(script: Script, body: Callable[[FakeDaemon], Coroutine[Any, Any, None]]) -> None:
    """Start the fake daemon on a free loopback port, run body(daemon), stop the server."""

    async def main() -> None:
        daemon = FakeDaemon(script)
        server = grpc.aio.server()
        pb_grpc.add_WorkerServiceServicer_to_server(daemon, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        daemon.address = f"127.0.0.1:{port}"
        try:
            await body(daemon)
        finally:
            await server.stop(None)

    asyncio.run(main())


def make_worker(daemon: FakeDaemon, instance: str = "i0", **kw: Any) -> Worker:
    options: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "block_size": BLOCK,
        "num_slots": 4,
        "reconnect_backoff_s": (0.01, 0.05),
        **kw,
    }
    factory = options.pop("factory", None) or sim_engine_factory(4, zero_cost=True)
    return Worker(daemon.address, instance, factory, **options)


def place(handle: int, slot: int, block_ids: list[int], prompt: list[int] = PROMPT) -> Placement:
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    return Placement(handle, slot, f"req-{handle}", block_ids, 0, len(prompt), 0, -1, sampling)


def expected_tokens(req_id: str, prompt_len: int = len(PROMPT), n: int = 8) -> list[int]:
    sim = SimExecutor(seed=0)
    return [sim.token_at(req_id, prompt_len + i) for i in range(n)]


# ---- one worker ------------------------------------------------------------------------------


def test_worker_runs_pipelined_chunks_and_reports_oracle_tokens() -> None:
    seen: dict[str, Any] = {}

    async def script(conn: Conn) -> None:
        seen["hello"] = await conn.wait_hello()
        await conn.welcome(heartbeat_s=0.2)
        await conn.send_tasks(Tasks(1, placements=[place(1, 0, [0, 1, 2, 3])], chunks=[]))
        await conn.send_tasks(Tasks(2, chunks=[Chunk(1, 0, PROMPT[:4])]))
        first = await conn.next_report()
        assert (first.handles, first.num_computed, first.token_ids) == ([1], [4], [])
        # The worker holds handle 1 and waits for its next chunk: idle on the daemon.
        await conn.send_tasks(Tasks(3, chunks=[Chunk(1, 4, PROMPT[4:])]))
        seen["tokens"] = await conn.tokens_until_finished(1)
        conn.heartbeat.clear()
        await asyncio.wait_for(conn.heartbeat.wait(), TIMEOUT)
        seen["kinds"] = list(conn.kinds)

    async def body(daemon: FakeDaemon) -> None:
        worker = make_worker(daemon, heartbeat_interval_s=5.0)
        await daemon.run(worker)  # returns when the script ends the stream with OK
        seen["stats"] = worker.stats

    run_test(script, body)
    hello = seen["hello"]
    assert (hello.instance_id, hello.rank, hello.world_size) == ("i0", 0, 1)
    assert (hello.num_gpu_blocks, hello.block_size, hello.num_slots) == (64, BLOCK, 4)
    assert (hello.protocol_version, hello.executor, hello.worker_address) == (1, "sim", "")
    assert seen["tokens"] == (expected_tokens("req-1"), FinishReason.LENGTH)
    assert seen["kinds"][0] == "hello" and "heartbeat" in seen["kinds"]
    stats = seen["stats"]
    assert stats.num_reports == stats.num_steps == 9  # two chunks, then 7 decodes
    assert stats.num_tokens == 8 and stats.num_tasks == 3 and stats.num_connects == 1
    assert stats.idle_waiting_on_daemon_s > 0
    assert 0 < stats.idle_frac_control_plane < 1


def test_reports_wait_for_answers_and_later_steps_merge_into_one() -> None:
    """With a daemon that answers reports (Welcome.answers_reports), the worker keeps stepping
    but has at most two reports unanswered; the steps in between go out as one merged report
    (a handle once per step) when an answer (Tasks.report_step) comes."""
    seen: dict[str, Any] = {}

    async def script(conn: Conn) -> None:
        await conn.wait_hello()
        await conn.welcome(answers_reports=True)
        sampling = SamplingParams(max_tokens=40, ignore_eos=True)
        placement = Placement(1, 0, "req-1", list(range(16)), 0, 4, 0, -1, sampling)
        await conn.send_tasks(Tasks(1, placements=[placement], chunks=[Chunk(1, 0, PROMPT[:4])]))
        first, second = await conn.next_report(), await conn.next_report()
        worker = seen["worker"]
        while worker.stats.num_steps < 7:  # it keeps decoding meanwhile
            await asyncio.sleep(0.001)
        assert conn.reports.empty(), "a third report went out unanswered"
        await conn.send_tasks(Tasks(2, report_step=first.step))
        merged = await conn.next_report()
        seen["reports"] = (first, second, merged)
        tokens = first.token_ids + second.token_ids + merged.token_ids
        while len(tokens) < 40:  # answer everything from now on
            await conn.send_tasks(Tasks(3, report_step=merged.step))
            merged = await conn.next_report()
            tokens += merged.token_ids
        seen["tokens"] = tokens

    async def body(daemon: FakeDaemon) -> None:
        seen["worker"] = worker = make_worker(daemon, num_gpu_blocks=64)
        await daemon.run(worker)

    run_test(script, body)
    first, second, merged = seen["reports"]
    assert (first.step, second.step) == (1, 2)
    assert merged.step >= second.step + 5 and merged.handles == [1] * (merged.step - 2)
    assert seen["tokens"] == expected_tokens("req-1", 4, 40)


def test_model_executor_steps_in_a_thread_and_matches_the_reference() -> None:
    from kvsched.worker_stub.model import ModelConfig, generate_reference

    prompt = [5, 900, 33, 1200, 7, 7, 64]
    seen: dict[str, Any] = {}

    async def script(conn: Conn) -> None:
        await conn.wait_hello()
        await conn.welcome()
        chunks = [Chunk(1, 0, prompt[:3]), Chunk(2, 0, prompt)]
        placements = [place(1, 0, [3, 1, 4, 0], prompt), place(2, 1, [9, 2, 6, 5], prompt)]
        await conn.send_tasks(Tasks(1, placements=placements, chunks=chunks))
        await conn.next_report()
        await conn.send_tasks(Tasks(2, chunks=[Chunk(1, 3, prompt[3:])]))
        seen[1] = await conn.tokens_until_finished(1)

    async def body(daemon: FakeDaemon) -> None:
        factory = model_engine_factory(4, 16)
        await daemon.run(make_worker(daemon, factory=factory, executor_name="model"))

    run_test(script, body)
    assert seen[1] == (generate_reference(ModelConfig(), prompt, 8), FinishReason.LENGTH)


def test_reconnect_starts_from_an_empty_engine() -> None:
    connects: list[Conn] = []
    seen: dict[str, Any] = {}

    async def script(conn: Conn) -> None:
        connects.append(conn)
        await conn.wait_hello()
        await conn.welcome()
        first = len(connects) == 1
        chunk = Chunk(1, 0, PROMPT[:4] if first else PROMPT)
        await conn.send_tasks(Tasks(1, placements=[place(1, 0, [0, 1, 2, 3])], chunks=[chunk]))
        if first:  # the worker holds handle 1, waiting for its next chunk, when the stream breaks
            await conn.next_report()
            await conn.context.abort(grpc.StatusCode.UNAVAILABLE, "daemon restarting")
        # Handle 1 again on slot 0: a worker that kept its state would call this a protocol error.
        seen["tokens"] = await conn.tokens_until_finished(1)

    async def body(daemon: FakeDaemon) -> None:
        worker = make_worker(daemon)
        await daemon.run(worker)
        seen["stats"] = worker.stats

    run_test(script, body)
    assert seen["tokens"] == (expected_tokens("req-1"), FinishReason.LENGTH)
    assert seen["stats"].num_connects == 2


def test_refused_hello_is_fatal() -> None:
    """A hello the daemon refuses for good ends the worker. (A refusal because the rank's old
    stream is still attached, "already connected", is retried instead:
    tests/integration/test_worker_already_connected.py.)"""

    async def script(conn: Conn) -> None:
        await conn.wait_hello()
        await conn.context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "rank 0 disagrees with the instance's ranks: block_size 16, theirs 32",
        )

    async def body(daemon: FakeDaemon) -> None:
        with pytest.raises(WorkerError, match="disagrees with the instance's ranks"):
            await daemon.run(make_worker(daemon))

    run_test(script, body)


def test_stop_ends_run_while_idle() -> None:
    welcomed = asyncio.Event()

    async def script(conn: Conn) -> None:
        await conn.wait_hello()
        await conn.welcome()
        welcomed.set()
        await asyncio.Event().wait()  # the daemon never ends the stream

    async def body(daemon: FakeDaemon) -> None:
        worker = make_worker(daemon)
        run = asyncio.create_task(worker.run())
        await asyncio.wait_for(welcomed.wait(), TIMEOUT)
        worker.stop()
        await asyncio.wait_for(run, TIMEOUT)

    run_test(script, body)


# ---- tensor parallel -------------------------------------------------------------------------


def test_tensor_parallel_ranks_get_identical_tasks_and_only_rank0_reports() -> None:
    both_said_hello = asyncio.Barrier(2)
    rank1_finished = asyncio.Event()
    rank_reports: dict[int, list[StepReport]] = {0: [], 1: []}
    seen: dict[str, Any] = {}

    def on_step(rank: int) -> Callable[[StepReport], None]:
        def record(report: StepReport) -> None:
            rank_reports[rank].append(report)
            if rank == 1 and any(report.finish_reasons):
                rank1_finished.set()

        return record

    async def script(conn: Conn) -> None:
        hello = await conn.wait_hello()
        await asyncio.wait_for(both_said_hello.wait(), TIMEOUT)
        await conn.welcome(heartbeat_s=1.0)
        await conn.send_tasks(Tasks(1, placements=[place(1, 2, [5, 6, 7, 8])]))
        await conn.send_tasks(Tasks(2, chunks=[Chunk(1, 0, PROMPT)]))
        if hello.rank == 0:
            seen["tokens"] = await conn.tokens_until_finished(1)
        else:
            await asyncio.wait_for(rank1_finished.wait(), TIMEOUT)
            conn.heartbeat.clear()
            await asyncio.wait_for(conn.heartbeat.wait(), TIMEOUT)
            seen["rank1_kinds"] = set(conn.kinds)

    async def body(daemon: FakeDaemon) -> None:
        workers = [make_worker(daemon, rank=r, world_size=2, on_step=on_step(r)) for r in range(2)]
        await daemon.run(*workers)
        seen["stats"] = [w.stats for w in workers]

    run_test(script, body)
    assert seen["tokens"] == (expected_tokens("req-1"), FinishReason.LENGTH)
    assert seen["rank1_kinds"] == {"hello", "heartbeat"}
    rank0, rank1 = seen["stats"]
    assert rank0.num_tasks == rank1.num_tasks == 2
    assert rank0.tasks_digest == rank1.tasks_digest != 0
    assert rank1.num_reports == 0 and rank0.num_reports == rank0.num_steps
    assert rank_reports[0] == rank_reports[1]  # the same steps, in lockstep


def finished_handles(reports: list[StepReport]) -> list[int]:
    return [h for r in reports for h, f in zip(r.handles, r.finish_reasons, strict=True) if f]


def test_a_lagging_tp_rank_defers_a_placement_until_its_slot_frees() -> None:
    """Rank 0 finished handle 1 and the daemon reused its slot; rank 1 (not in lockstep here)
    still runs handle 1 when that placement arrives. It applies the placement once its own
    steps finish handle 1, instead of dropping the stream over an occupied slot."""
    reports: list[StepReport] = []
    seen: dict[str, Any] = {}

    async def script(conn: Conn) -> None:
        await conn.wait_hello()
        await conn.welcome(heartbeat_s=1.0)
        first = Tasks(1, placements=[place(1, 0, [0, 1, 2, 3])], chunks=[Chunk(1, 0, PROMPT)])
        second = Tasks(2, placements=[place(2, 0, [4, 5, 6, 7])], chunks=[Chunk(2, 0, PROMPT)])
        await conn.send(tasks=codec.tasks_to_proto(first))
        await conn.send(tasks=codec.tasks_to_proto(second))  # slot 0 is still busy there
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while 2 not in finished_handles(reports):
            assert asyncio.get_running_loop().time() < deadline, "handle 2 never finished"
            await asyncio.sleep(0.005)

    async def body(daemon: FakeDaemon) -> None:
        worker = make_worker(daemon, rank=1, world_size=2, on_step=reports.append)
        await daemon.run(worker)
        seen["stats"] = worker.stats

    run_test(script, body)
    assert seen["stats"].num_connects == 1
    assert finished_handles(reports) == [1, 2]
    tokens = {1: [], 2: []}  # type: dict[int, list[int]]
    for r in reports:
        pos = 0
        for h, n in zip(r.handles, r.num_new_tokens, strict=True):
            tokens[h] += r.token_ids[pos : pos + n]
            pos += n
    assert tokens[1] == expected_tokens("req-1") and tokens[2] == expected_tokens("req-2")


# ---- KV push between workers -----------------------------------------------------------------


def test_kv_push_lands_only_in_a_held_handle() -> None:
    token = "s3cret"
    d_known = asyncio.Event()  # loop-bound lazily: safe to create outside asyncio.run
    done = asyncio.Event()
    seen: dict[str, Any] = {}

    async def decode(conn: Conn) -> None:
        hello = await conn.wait_hello()
        seen["d_address"] = hello.worker_address
        seen["decode_conn"] = conn
        d_known.set()
        await conn.welcome()
        # Reservation handle 5: a placement that never gets chunks.
        await conn.send_tasks(Tasks(1, placements=[place(5, 0, [0, 1, 2])]))
        await asyncio.wait_for(done.wait(), TIMEOUT)

    async def prefill(conn: Conn) -> None:
        await conn.wait_hello()
        await conn.welcome()
        await asyncio.wait_for(d_known.wait(), TIMEOUT)
        address = seen["d_address"]
        await conn.send(peers=pb.Peers(peers=[pb.Peers.Peer(instance_id="d", address=address)]))
        placements = [place(h, h, [10 * h, 10 * h + 1]) for h in (1, 2, 3)]
        chunks = [Chunk(h, 0, PROMPT) for h in (1, 2, 3)]
        sends = [
            KvSend(1, "d", 5, [0, 1, 2]),  # held: lands (2 blocks of prompt: cut to [0, 1])
            KvSend(2, "d", 3, [3, 4]),  # below every handle placed on d, not held: refused
            KvSend(3, "nowhere", 5, [0, 1]),  # no peer address
        ]
        await conn.send_tasks(Tasks(1, placements=placements, chunks=chunks, kv_sends=sends))
        seen["prefill_report"] = await conn.next_report()
        await asyncio.wait_for(done.wait(), TIMEOUT)

    async def script(conn: Conn) -> None:
        hello = await conn.wait_hello()
        await (decode(conn) if hello.instance_id == "d" else prefill(conn))

    async def body(daemon: FakeDaemon) -> None:
        kw: dict[str, Any] = {"kv_listen": "127.0.0.1:0", "kv_token": token}
        d = make_worker(daemon, "d", push_wait_s=0.3, **kw)
        p = make_worker(daemon, "p", **kw)
        run = asyncio.create_task(daemon.run(d, p))
        try:
            await asyncio.wait_for(d_known.wait(), TIMEOUT)
            assert d.kv_address == seen["d_address"]
            await check_direct_pushes(d, seen, token)
        finally:
            done.set()
        await run
        seen["stats"] = (d.stats, p.stats)

    run_test(script, body)
    report = seen["prefill_report"]
    assert report.handles == [1, 2, 3] and report.num_new_tokens == [1, 1, 1]
    assert sorted(report.failed) == [2, 3]
    d_stats, p_stats = seen["stats"]
    assert (p_stats.num_kv_pushes, p_stats.num_kv_push_failures) == (1, 1)
    assert d_stats.num_kv_received == 1 + 2  # the prefill's push and two direct ones


async def check_direct_pushes(d: Worker, seen: dict[str, Any], token: str) -> None:
    """Call d's KvTransferService as a peer would."""
    sim = SimExecutor()
    auth = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(d.kv_address or "") as channel:
        stub = kv_grpc.KvTransferServiceStub(channel)

        async def push(handle: int, blocks: list[int], **kw: Any) -> grpc.StatusCode:
            fields: dict[str, Any] = {
                "src_instance_id": "test",
                "dst_instance_id": "d",
                "kv_data": sim.export_kv(blocks),
                **kw,
            }
            request = kv_pb2.PushRequest(dst_handle=handle, dst_block_ids=blocks, **fields)
            try:
                await stub.Push(request, timeout=TIMEOUT, metadata=auth)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        # Once d has the reservation handle 5 (its first Tasks), pushes to it land.
        assert await push(5, [2]) is grpc.StatusCode.OK
        failed_precondition = grpc.StatusCode.FAILED_PRECONDITION
        assert await push(4, [1]) is failed_precondition  # never placed, below handle 5
        assert await push(5, [1], dst_instance_id="other") is failed_precondition
        assert await push(5, [1], rank=1) is failed_precondition
        assert await push(5, [0, 1], kv_data=sim.export_kv([0])) is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Push(kv_pb2.PushRequest(dst_instance_id="d", dst_handle=5), timeout=TIMEOUT)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # A push may overtake the Tasks that place its handle: it waits for the placement.
        overtaking = asyncio.create_task(push(9, [5, 6]))
        await seen["decode_conn"].send_tasks(Tasks(2, placements=[place(9, 1, [5, 6])]))
        assert await overtaking is grpc.StatusCode.OK
        # A handle that is never placed: refused after push_wait_s.
        assert await push(20, [7]) is failed_precondition
