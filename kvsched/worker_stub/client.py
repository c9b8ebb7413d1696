"""The reference worker's gRPC client: one Connect stream to the daemon, a step loop, KV pushes.

One session is one `WorkerService.Connect` stream (DESIGN section 4); a broken stream is retried
with backoff, and every session starts from an empty cache. Inside a session three tasks run:

    daemon --ConnectResponse--> _read_stream ---inbox---> _step_loop: at each step boundary
             (peers: kept in a map at once)     ^            apply all, step, push KV, report
    peer --KvTransferService.Push---------------+            sim: sleep out step_time_s
                                                             model: step() in a thread
    _heartbeats: one heartbeat whenever nothing was sent for the interval

Everything that touches the engine runs in the step loop (or in its thread, while the loop
awaits it), so the engine needs no lock. The loop never awaits the daemon while it has runnable
work: outgoing messages go through an unbounded queue that gRPC drains.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import random
import signal
import socket
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from kvsched import codec
from kvsched.core.errors import KvschedError, ProtocolError
from kvsched.core.protocol import KvSend, StepReport, Tasks
from kvsched.v1 import kv_transfer_service_pb2 as kv_pb2
from kvsched.v1 import kv_transfer_service_pb2_grpc as kv_grpc
from kvsched.v1 import worker_service_pb2 as pb
from kvsched.worker_stub.engine import KvSender, WorkerEngine
from kvsched.worker_stub.sim import SimExecutor

log = logging.getLogger(__name__)

__all__ = [
    "EngineFactory",
    "EngineSettings",
    "Worker",
    "WorkerError",
    "WorkerStats",
    "model_engine_factory",
    "run_worker",
    "sim_engine_factory",
    "worker_from_args",
]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The daemon must accept pings this often: grpc.http2.min_ping_interval_without_data_ms <= 20 s.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS = CHANNEL_OPTIONS[:2]
_CONNECT = "/kvsched.v1.WorkerService/Connect"
# The daemon refused this worker: retrying the same hello cannot help.
_FATAL_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
_SIM_MAX_MODEL_LEN = 1 << 20  # the sim has no length limit of its own
_MAX_OVERSLEEP_CREDIT_S = 0.002
# Reports sent and not yet answered by a Tasks message (its report_step) before later steps'
# reports are held and merged: two in flight, as the daemon's own pipelining (DESIGN 4) assumes.
MAX_UNANSWERED = 2


class WorkerError(KvschedError):
    """The daemon refused this worker for good (bad hello, credentials, protocol version)."""


# ---- engines --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the daemon's Welcome fixes for the engine."""

    block_size: int
    num_speculative_tokens: int
    max_model_len: int  # 0: the executor's own limit


EngineFactory = Callable[[EngineSettings, KvSender], WorkerEngine]


def sim_engine_factory(
    num_slots: int,
    *,
    gpu: str = "h100",
    speed: float = 1.0,
    zero_cost: bool = False,
    seed: int = 0,
    eos_every: int | None = None,
) -> EngineFactory:
    """Engines over a `SimExecutor`; the arguments are checked now, not after the Welcome."""
    SimExecutor(gpu=gpu, speed=speed, zero_cost=zero_cost, seed=seed, eos_every=eos_every)

    def build(settings: EngineSettings, kv_sender: KvSender) -> WorkerEngine:
        sim = SimExecutor(gpu=gpu, speed=speed, zero_cost=zero_cost, seed=seed, eos_every=eos_every)
        return WorkerEngine(
            sim,
            settings.block_size,
            num_slots,
            sim.eos_token_id,
            settings.max_model_len or _SIM_MAX_MODEL_LEN,
            settings.num_speculative_tokens,
            kv_sender=kv_sender,
            columnar=True,
        )

    return build


def model_engine_factory(
    num_slots: int, num_blocks: int, *, seed: int = 0, backend: str = "numpy"
) -> EngineFactory:
    """Engines over a `PagedModelExecutor` of `ModelConfig(seed=seed)`. Imports numpy (and
    Paddle for that backend) when called: set thread-count variables before."""
    from kvsched.worker_stub.model import ModelConfig, PagedModelExecutor, get_backend

    config = ModelConfig(seed=seed)
    array_backend = get_backend(backend, config.dtype)

    def build(settings: EngineSettings, kv_sender: KvSender) -> WorkerEngine:
        executor = PagedModelExecutor(config, num_blocks, settings.block_size, array_backend)
        max_model_len = min(settings.max_model_len or config.max_model_len, config.max_model_len)
        return WorkerEngine(
            executor,
            settings.block_size,
            num_slots,
            config.eos_token_id,
            max_model_len,
            settings.num_speculative_tokens,
            kv_sender=kv_sender,
        )

    return build


def _num_send_blocks(engine: WorkerEngine, handle: int) -> int:
    """Blocks the engine exports for a due KvSend (it passes the whole dst list; the receiver
    needs exactly as many ids as exported blocks). Called from inside step(), handle still held.
    TODO(engine): have WorkerEngine pass the KvSend cut to the exported block count."""
    return -(-engine.num_computed(handle) // engine.block_size)


# ---- stats ----------------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerStats:
    """Counters over the worker's life (all sessions). Times are wall seconds."""

    num_connects: int = 0
    num_steps: int = 0
    num_tokens: int = 0  # sampled tokens kept (every rank counts its own)
    num_reports: int = 0
    num_paused: int = 0  # report rows saying a slot waits for blocks
    num_heartbeats: int = 0
    num_tasks: int = 0
    tasks_digest: int = 0  # crc32 chained over each Tasks ConnectResponse's bytes, in order
    busy_s: float = 0.0  # in steps: compute (or simulated GPU time), KV pushes
    idle_s: float = 0.0  # nothing runnable
    idle_waiting_on_daemon_s: float = 0.0  # nothing runnable while holding a handle
    num_kv_pushes: int = 0
    num_kv_push_failures: int = 0
    num_kv_received: int = 0

    @property
    def idle_frac_control_plane(self) -> float:
        """worker_idle_frac_control_plane: of the time the worker held work, the fraction it
        sat idle waiting only on the daemon (a chunk, a block extension, a KV reservation)."""
        active = self.busy_s + self.idle_waiting_on_daemon_s
        return self.idle_waiting_on_daemon_s / active if active else 0.0


@dataclass(slots=True)
class _KvPush:
    """A received push waiting for the step boundary; the future gets (code, message)."""

    request: kv_pb2.PushRequest
    future: asyncio.Future[tuple[grpc.StatusCode, str]]


_InboxItem = Tasks | pb.Welcome | _KvPush


@dataclass(slots=True)
class _DuePush:
    send: KvSend
    address: str
    data: bytes


# ---- the worker -----------------------------------------------------------------------------


class Worker:
    """A worker process's connection to the daemon. Create it, then `await run()`; call
    `stop()` (from the loop's thread) to leave. Usable in-process by tests.

    on_step is called after every step on every rank with its report (rank 0 sends it).
    """

    def __init__(
        self,
        server: str,
        instance_id: str,
        engine_factory: EngineFactory,
        *,
        rank: int = 0,
        world_size: int = 1,
        num_gpu_blocks: int,
        block_size: int,
        num_slots: int,
        model: str = "default",
        executor_name: str = "sim",
        channel_credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        heartbeat_interval_s: float = 1.0,
        kv_listen: str | None = None,
        kv_server_credentials: grpc.ServerCredentials | None = None,
        kv_token: str | None = None,
        push_timeout_s: float = 30.0,
        push_wait_s: float = 5.0,
        reconnect_backoff_s: tuple[float, float] = (0.1, 5.0),
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        self.server = server
        self.instance_id = instance_id
        self.rank = rank
        self.world_size = world_size
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.num_slots = num_slots
        self.model = model
        self.executor_name = executor_name
        self._factory = engine_factory
        self._credentials = channel_credentials
        self._metadata = tuple(metadata)
        self._default_heartbeat_s = heartbeat_interval_s
        self._kv_listen = kv_listen
        self._kv_server_credentials = kv_server_credentials
        self._kv_metadata = (("authorization", f"Bearer {kv_token}"),) if kv_token else ()
        self._push_timeout_s = push_timeout_s
        self._push_wait_s = push_wait_s
        self._backoff_s = reconnect_backoff_s
        self._on_step = on_step
        self.stats = WorkerStats()
        self.engine: WorkerEngine | None = None
        self.kv_address: str | None = None  # host:port peers push to, once run() started it
        self._settings: EngineSettings | None = None
        self._stopping = asyncio.Event()
        self._inbox: asyncio.Queue[_InboxItem] | None = None
        self._pending_pushes: list[_KvPush] = []
        self._due_pushes: list[_DuePush] = []
        self._peers: dict[tuple[str, int], str] = {}  # (instance_id, rank) -> KV address
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        self._max_placed = 0  # highest handle placed this session
        self._heartbeat_s = heartbeat_interval_s
        self._last_sent = 0.0
        self._oversleep_s = 0.0
        self._welcomed = asyncio.Event()  # set once the current session is welcomed
        # Report pacing: steps of the reports sent and not yet answered (Tasks.report_step),
        # and the merged report of later steps held back meanwhile.
        self._unanswered: collections.deque[int] = collections.deque()
        self._held: pb.ConnectRequest | None = None
        self._paced = False  # this session's daemon answers reports (Welcome.answers_reports)
        self._deferred: collections.deque[Tasks] = collections.deque()  # ranks > 0, see below

    def stop(self) -> None:
        """Leave: run() closes the stream and returns. Safe to call more than once."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve the daemon until it ends the stream with OK or stop() is called. A broken
        stream is retried with jittered exponential backoff. Raises WorkerError when the daemon
        refuses this worker (FAILED_PRECONDITION, INVALID_ARGUMENT, UNAUTHENTICATED, ...)."""
        kv_server = await self._start_kv_server() if self._kv_listen else None
        backoff = self._backoff_s[0]
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    if await self._session():
                        if not self._stopping.is_set():
                            log.info("daemon %s ended the stream (OK): leaving", self.server)
                        return
                except grpc.aio.AioRpcError as e:
                    if e.code() in _FATAL_CODES:
                        msg = f"daemon refused worker: {e.code().name}: {e.details()}"
                        raise WorkerError(msg) from e
                    log.warning(
                        "stream to %s broke: %s: %s", self.server, e.code().name, e.details()
                    )
                except (ProtocolError, ValueError) as e:  # the daemon sent something unusable
                    log.error("dropping the stream to %s: %s", self.server, e)
                if time.monotonic() - started >= self._backoff_s[1]:
                    backoff = self._backoff_s[0]  # it ran a while: not a crash loop
                delay = backoff * random.uniform(0.5, 1.0)
                backoff = min(2 * backoff, self._backoff_s[1])
                log.info("reconnecting to %s in %.2f s", self.server, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
        finally:
            for channel in self._peer_channels.values():
                await channel.close()
            self._peer_channels.clear()
            if kv_server is not None:
                await kv_server.stop(grace=0.5)

    # ---- one session ------------------------------------------------------------------------

    async def _session(self) -> bool:
        """One Connect stream. True when it ended for good: the daemon closed it with OK, or
        stop() was called. Raises when it broke."""
        inbox: asyncio.Queue[_InboxItem] = asyncio.Queue()
        outbox: asyncio.Queue[pb.ConnectRequest | None] = asyncio.Queue()
        self._inbox, self._heartbeat_s = inbox, self._default_heartbeat_s
        self._unanswered.clear()
        self._held = None
        self._deferred.clear()
        self._welcomed = asyncio.Event()
        async with self._open_channel(self.server) as channel:
            # Raw response bytes (no deserializer): the digest covers exactly what was sent.
            connect = channel.stream_stream(
                _CONNECT, request_serializer=pb.ConnectRequest.SerializeToString
            )
            self._send(outbox, pb.ConnectRequest(hello=self._hello()))
            call = connect(_drain(outbox), metadata=self._metadata)
            self.stats.num_connects += 1
            jobs = [
                asyncio.create_task(self._read_stream(call, inbox)),
                asyncio.create_task(self._step_loop(inbox, outbox)),
                asyncio.create_task(self._heartbeats(outbox)),
                asyncio.create_task(self._stopping.wait()),
            ]
            try:
                done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                self._inbox = None
                self._fail_pending_pushes(inbox)
                outbox.put_nowait(None)  # half-close: the worker leaves
                call.cancel()
        for job in done:
            job.result()  # the first failure, if any
        return True

    def _open_channel(self, target: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(target, self._credentials, options=CHANNEL_OPTIONS)

    def _hello(self) -> pb.Hello:
        return pb.Hello(
            instance_id=self.instance_id,
            rank=self.rank,
            world_size=self.world_size,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            num_slots=self.num_slots,
            model=self.model,
            protocol_version=codec.PROTOCOL_VERSION,
            worker_address=self.kv_address or "",
            executor=self.executor_name,
        )

    def _send(
        self, outbox: asyncio.Queue[pb.ConnectRequest | None], msg: pb.ConnectRequest
    ) -> None:
        outbox.put_nowait(msg)
        self._last_sent = time.monotonic()

    async def _read_stream(
        self, call: grpc.aio.StreamStreamCall, inbox: asyncio.Queue[_InboxItem]
    ) -> None:
        """Route the daemon's messages until it ends the stream with OK (return) or it breaks
        (AioRpcError)."""
        while (raw := await call.read()) is not grpc.aio.EOF:
            msg = pb.ConnectResponse.FromString(raw)
            kind = msg.WhichOneof("kind")
            if kind == "tasks":
                self.stats.num_tasks += 1
                self.stats.tasks_digest = zlib.crc32(raw, self.stats.tasks_digest)
                inbox.put_nowait(codec.tasks_from_proto(msg.tasks))
            elif kind == "welcome":
                inbox.put_nowait(msg.welcome)
            elif kind == "peers":
                self._peers = {(p.instance_id, p.rank): p.address for p in msg.peers.peers}
                log.info("KV peers: %s", self._peers)
            # heartbeat: the message itself is the news

    async def _heartbeats(self, outbox: asyncio.Queue[pb.ConnectRequest | None]) -> None:
        """A heartbeat whenever nothing else was sent for the interval (the welcome's)."""
        await self._welcomed.wait()
        while True:
            wait = self._last_sent + self._heartbeat_s - time.monotonic()
            if wait <= 0:
                self._send(
                    outbox, pb.ConnectRequest(heartbeat=pb.Heartbeat(time_ns=time.time_ns()))
                )
                self.stats.num_heartbeats += 1
                wait = self._heartbeat_s
            await asyncio.sleep(wait)

    # ---- the step loop ----------------------------------------------------------------------

    async def _step_loop(
        self, inbox: asyncio.Queue[_InboxItem], outbox: asyncio.Queue[pb.ConnectRequest | None]
    ) -> None:
        engine = self._start_engine(await self._welcome(inbox))
        while True:
            while not inbox.empty():
                self._accept(engine, inbox.get_nowait(), outbox)
            self._resolve_pushes(engine)
            if engine.has_runnable():
                await self._step(engine, outbox)
                self._apply_deferred(engine)
                continue
            if self._deferred:  # nothing left to step towards: apply (a conflict raises)
                self._apply_deferred(engine, force=True)
                continue
            waiting_on_daemon = engine.num_held > 0
            started = time.perf_counter()
            item = await inbox.get()
            idle = time.perf_counter() - started
            self.stats.idle_s += idle
            if waiting_on_daemon:
                self.stats.idle_waiting_on_daemon_s += idle
            self._accept(engine, item, outbox)

    def _apply_deferred(self, engine: WorkerEngine, force: bool = False) -> None:
        """Ranks > 0 step on their own, not in lockstep with rank 0 as real TP ranks are: one
        that lags may get a placement on a slot whose occupant rank 0 has already finished.
        Such Tasks wait (in order) until this rank's own steps free the slot."""
        deferred = self._deferred
        while deferred and (force or engine.slots_free_for(deferred[0])):
            engine.apply(deferred.popleft())
            force = False

    async def _welcome(self, inbox: asyncio.Queue[_InboxItem]) -> pb.Welcome:
        while True:
            item = await inbox.get()
            if isinstance(item, pb.Welcome):
                return item
            if isinstance(item, _KvPush):  # resolved once the engine runs
                self._pending_pushes.append(item)
                continue
            raise ProtocolError(f"the daemon sent {type(item).__name__} before welcome")

    def _start_engine(self, welcome: pb.Welcome) -> WorkerEngine:
        """The engine for this session, empty: reset when the settings are unchanged."""
        if welcome.protocol_version not in (0, codec.PROTOCOL_VERSION):
            raise WorkerError(
                f"daemon speaks worker protocol {welcome.protocol_version}, "
                f"this worker {codec.PROTOCOL_VERSION}"
            )
        settings = EngineSettings(
            block_size=welcome.block_size or self.block_size,
            num_speculative_tokens=welcome.num_speculative_tokens,
            max_model_len=welcome.max_model_len,
        )
        if self.engine is not None and settings == self._settings:
            self.engine.reset()
        else:
            self.engine = self._factory(settings, self._queue_kv_push)
        self._settings = settings
        self._paced = welcome.answers_reports
        self._max_placed = 0
        self._welcomed.set()
        if welcome.heartbeat_interval_ns:
            self._heartbeat_s = welcome.heartbeat_interval_ns / 1e9
        log.info(
            "welcomed by %s as %s rank %d/%d: %s",
            self.server,
            self.instance_id,
            self.rank,
            self.world_size,
            settings,
        )
        return self.engine

    def _accept(
        self,
        engine: WorkerEngine,
        item: _InboxItem,
        outbox: asyncio.Queue[pb.ConnectRequest | None],
    ) -> None:
        if isinstance(item, Tasks):
            if self.rank == 0:
                engine.apply(item)
                self._answered(outbox, item.report_step)
            else:
                self._deferred.append(item)
                self._apply_deferred(engine)
            for p in item.placements:
                self._max_placed = max(self._max_placed, p.handle)
        elif isinstance(item, _KvPush):
            self._pending_pushes.append(item)
        else:
            log.warning("ignoring a second welcome on one stream")

    async def _step(
        self, engine: WorkerEngine, outbox: asyncio.Queue[pb.ConnectRequest | None]
    ) -> None:
        started = time.perf_counter()
        if engine.executor.name == "sim":
            report = engine.step()
            await self._simulate_gpu(started, report.step_time_ns / 1e9 if report else 0.0)
        else:  # real compute: keep the loop free to receive tasks and pushes meanwhile
            report = await asyncio.to_thread(engine.step)
        due, self._due_pushes = self._due_pushes, []
        if due:
            await self._push_all(due, report)
        self.stats.num_steps += 1
        self.stats.busy_s += time.perf_counter() - started
        if report is None:
            return
        self.stats.num_tokens += sum(report.num_new_tokens)
        self.stats.num_paused += len(report.paused)
        if self.rank == 0:
            self._report(outbox, codec.report_message(report))
        if self._on_step is not None:
            self._on_step(report)

    def _report(
        self, outbox: asyncio.Queue[pb.ConnectRequest | None], msg: pb.ConnectRequest
    ) -> None:
        """Send a step's report, or hold it while MAX_UNANSWERED reports wait for the daemon's
        answer: held reports merge into one (columns appended, the later step), sent as soon as
        an answer comes. A daemon that falls behind then gets fewer, larger reports instead of
        a growing queue of stale ones, and its decisions stay within a few steps of the worker.
        """
        if self._held is not None:
            self._held.MergeFrom(msg)
        elif self._paced and len(self._unanswered) >= MAX_UNANSWERED:
            self._held = msg
        else:
            self._send(outbox, msg)
            if self._paced:
                self._unanswered.append(msg.report.step)
            self.stats.num_reports += 1

    def _answered(self, outbox: asyncio.Queue[pb.ConnectRequest | None], report_step: int) -> None:
        """A Tasks message says the daemon applied reports up to report_step."""
        unanswered = self._unanswered
        while unanswered and unanswered[0] <= report_step:
            unanswered.popleft()
        if self._held is not None and len(unanswered) < MAX_UNANSWERED:
            msg, self._held = self._held, None
            self._send(outbox, msg)
            unanswered.append(msg.report.step)  # merged: the latest step
            self.stats.num_reports += 1

    async def _simulate_gpu(self, started: float, step_time_s: float) -> None:
        """Sleep out the simulated step. asyncio wakes up to ~1 ms late (epoll rounds its
        timeout up to whole ms); the next step sleeps that much less so steps average right."""
        if step_time_s <= 0:
            await asyncio.sleep(0)  # zero-cost: only yield to the reader and heartbeats
            return
        target = started + step_time_s - self._oversleep_s
        await asyncio.sleep(max(0.0, target - time.perf_counter()))
        late = time.perf_counter() - target
        self._oversleep_s = min(max(late, 0.0), _MAX_OVERSLEEP_CREDIT_S)

    # ---- KV pushes, sending side ------------------------------------------------------------

    def _queue_kv_push(self, send: KvSend, data: bytes) -> None:
        """The engine's kv_sender (called inside step(), maybe in a thread): note the push; the
        step loop performs it before the step's report goes out."""
        address = self._peers.get((send.dst_instance, self.rank))
        if address is None:
            raise LookupError(
                f"no KV address for instance {send.dst_instance!r} rank {self.rank}: "
                f"the daemon sent no Peers entry for it"
            )
        assert self.engine is not None
        num_blocks = _num_send_blocks(self.engine, send.handle)
        cut = KvSend(
            send.handle, send.dst_instance, send.dst_handle, send.dst_block_ids[:num_blocks]
        )
        self._due_pushes.append(_DuePush(cut, address, data))

    async def _push_all(self, due: list[_DuePush], report: StepReport | None) -> None:
        """Push concurrently; a failed push lists its handle in the report's `failed`."""
        results = await asyncio.gather(*(self._push(p) for p in due), return_exceptions=True)
        for p, result in zip(due, results, strict=True):
            if isinstance(result, Exception):
                self.stats.num_kv_push_failures += 1
                log.warning(
                    "KV push of handle %d to %s handle %d at %s failed: %s",
                    p.send.handle,
                    p.send.dst_instance,
                    p.send.dst_handle,
                    p.address,
                    result,
                )
                if report is not None:
                    report.failed.append(p.send.handle)
            else:
                self.stats.num_kv_pushes += 1

    async def _push(self, p: _DuePush) -> None:
        channel = self._peer_channels.get(p.address)
        if channel is None:
            channel = self._peer_channels[p.address] = self._open_channel(p.address)
        request = kv_pb2.PushRequest(
            src_instance_id=self.instance_id,
            dst_instance_id=p.send.dst_instance,
            rank=self.rank,
            dst_handle=p.send.dst_handle,
            dst_block_ids=p.send.dst_block_ids,
            kv_data=p.data,
        )
        stub = kv_grpc.KvTransferServiceStub(channel)
        await stub.Push(request, timeout=self._push_timeout_s, metadata=self._kv_metadata)

    # ---- KV pushes, receiving side ----------------------------------------------------------

    async def _start_kv_server(self) -> grpc.aio.Server:
        assert self._kv_listen is not None
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        kv_grpc.add_KvTransferServiceServicer_to_server(_KvTransferServicer(self), server)
        if self._kv_server_credentials is None:
            port = server.add_insecure_port(self._kv_listen)
        else:
            port = server.add_secure_port(self._kv_listen, self._kv_server_credentials)
        await server.start()
        self.kv_address = _advertised_address(self._kv_listen, port)
        log.info("accepting KV pushes at %s", self.kv_address)
        return server

    async def receive_kv(self, request: kv_pb2.PushRequest) -> tuple[grpc.StatusCode, str]:
        """Queue a received push for the step boundary and wait for its outcome: OK once the
        data is written into the blocks of a held handle."""
        if request.dst_instance_id and request.dst_instance_id != self.instance_id:
            return _refused(
                f"this is instance {self.instance_id!r}, not {request.dst_instance_id!r}"
            )
        if request.rank != self.rank:
            return _refused(
                f"this is rank {self.rank}; a rank {request.rank} pushes to rank {request.rank}"
            )
        inbox = self._inbox
        if inbox is None:
            return _refused(
                f"instance {self.instance_id!r} rank {self.rank} is not connected to the daemon"
            )
        push = _KvPush(request, asyncio.get_running_loop().create_future())
        inbox.put_nowait(push)
        try:
            return await asyncio.wait_for(push.future, self._push_wait_s)
        except TimeoutError:
            return _refused(
                f"handle {request.dst_handle} was not placed on instance {self.instance_id!r} "
                f"within {self._push_wait_s} s"
            )

    def _resolve_pushes(self, engine: WorkerEngine) -> None:
        """Write pushes for held handles; keep those whose placement may still be on its way
        (a handle above every handle placed so far: handles are issued in increasing order)."""
        waiting = []
        for push in self._pending_pushes:
            handle = push.request.dst_handle
            if push.future.done():  # the pusher gave up
                continue
            if engine.holds(handle):
                _answer(push, *self._import_kv(engine, push.request))
            elif handle > self._max_placed:
                waiting.append(push)
            else:
                _answer(
                    push,
                    *_refused(
                        f"handle {handle} is not held here (finished, dropped or never placed)"
                    ),
                )
        self._pending_pushes = waiting

    def _import_kv(
        self, engine: WorkerEngine, request: kv_pb2.PushRequest
    ) -> tuple[grpc.StatusCode, str]:
        try:
            engine.executor.import_kv(request.dst_block_ids[:], request.kv_data)
        except ValueError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, f"handle {request.dst_handle}: {e}"
        self.stats.num_kv_received += 1
        return grpc.StatusCode.OK, ""

    def _fail_pending_pushes(self, inbox: asyncio.Queue[_InboxItem]) -> None:
        while not inbox.empty():
            item = inbox.get_nowait()
            if isinstance(item, _KvPush):
                self._pending_pushes.append(item)
        for push in self._pending_pushes:
            _answer(push, *_refused("the worker lost its daemon stream; its cache is gone"))
        self._pending_pushes = []

    def check_kv_auth(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """True when KV pushes need no token or `metadata` carries this worker's."""
        if not self._kv_metadata:
            return True
        return any((k, v) == self._kv_metadata[0] for k, v in metadata or ())


class _KvTransferServicer(kv_grpc.KvTransferServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def Push(
        self, request: kv_pb2.PushRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PushResponse:
        if not self._worker.check_kv_auth(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong KV push token")
        code, message = await self._worker.receive_kv(request)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)
        return kv_pb2.PushResponse(num_blocks=len(request.dst_block_ids))


def _refused(message: str) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.FAILED_PRECONDITION, message


def _answer(push: _KvPush, code: grpc.StatusCode, message: str) -> None:
    if not push.future.done():
        push.future.set_result((code, message))


async def _drain(
    outbox: asyncio.Queue[pb.ConnectRequest | None],
) -> AsyncIterator[pb.ConnectRequest]:
    """The stream's messages in order. Reports still queued behind one another (the worker
    stepped faster than the stream drained) go out merged into one: columns concatenated, the
    later step number and applied seq. The daemon applies rows in order, so a handle may appear
    once per merged step; it sees every token sooner and pays for one message instead of many."""
    carry: object = _NOTHING
    while True:
        msg = await outbox.get() if carry is _NOTHING else carry
        carry = _NOTHING
        if not isinstance(msg, pb.ConnectRequest):
            return  # None: the stream is done
        if msg.WhichOneof("kind") == "report":
            while not outbox.empty():
                nxt = outbox.get_nowait()
                if nxt is not None and nxt.WhichOneof("kind") == "report":
                    msg.MergeFrom(nxt)  # repeated columns append; scalars take the later
                else:
                    carry = nxt
                    break
        yield msg


_NOTHING = object()


def _advertised_address(listen: str, port: int) -> str:
    """host:port peers can reach: a wildcard listen host advertises this machine's name."""
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- the `kvsched worker` command -----------------------------------------------------------


def worker_from_args(args: argparse.Namespace) -> Worker:
    """A Worker configured from the CLI's arguments; ValueError / OSError on bad ones."""
    if args.executor == "sim":
        factory = sim_engine_factory(
            args.num_slots, gpu=args.gpu, speed=args.speed, zero_cost=args.zero_cost, seed=args.seed
        )
    elif args.executor == "model":
        factory = model_engine_factory(
            args.num_slots, args.num_blocks, seed=args.seed, backend=args.backend
        )
    else:
        raise ValueError(f"executor must be 'sim' or 'model', got {args.executor!r}")
    ca, cert, key = (_read(p) for p in (args.tls_ca, args.tls_cert, args.tls_key))
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    credentials = None
    if ca is not None or cert is not None:
        credentials = grpc.ssl_channel_credentials(ca, key, cert)
    kv_server_credentials = None
    if cert is not None and key is not None:
        kv_server_credentials = grpc.ssl_server_credentials([(key, cert)])
    return Worker(
        args.server,
        args.instance,
        factory,
        rank=args.rank,
        world_size=args.world_size,
        num_gpu_blocks=args.num_blocks,
        block_size=args.block_size,
        num_slots=args.num_slots,
        executor_name=args.executor,
        channel_credentials=credentials,
        metadata=(("authorization", f"Bearer {args.token}"),) if args.token else (),
        kv_listen=args.listen_kv or None,
        kv_server_credentials=kv_server_credentials,
        kv_token=args.token or None,
    )


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def run_worker(args: argparse.Namespace) -> int:
    """`kvsched worker`: connect and serve until the daemon ends the stream or SIGTERM/SIGINT
    (exit 0); exit 1 when the daemon refuses the worker, 2 on bad arguments."""
    # One BLAS thread per process: two numpy workers on two cores otherwise run ~15x slower.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        worker = worker_from_args(args)
    except (ValueError, OSError) as e:
        log.error("bad worker arguments: %s", e)
        return 2
    return asyncio.run(_serve(worker))


async def _serve(worker: Worker) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        await worker.run()
    except WorkerError as e:
        log.error("%s", e)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        s = worker.stats
        log.info(
            "worker stats: %d steps, %d tokens, %d paused, busy %.3f s, idle %.3f s "
            "(%.3f s waiting on the daemon, idle_frac_control_plane %.3f), %d connects, "
            "%d tasks messages, tasks digest %08x",
            s.num_steps,
            s.num_tokens,
            s.num_paused,
            s.busy_s,
            s.idle_s,
            s.idle_waiting_on_daemon_s,
            s.idle_frac_control_plane,
            s.num_connects,
            s.num_tasks,
            s.tasks_digest,
        )
    return 0
