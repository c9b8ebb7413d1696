"""The worker's session with the daemon: one `WorkerService.Connect` stream at a time (hello,
welcome, heartbeats), retried with backoff when it breaks. Every session starts from an empty
cache. The protocol's rules are in the WorkerService comment of
`protos/kvsched/v1/worker_service.proto`. Inside a session three tasks run:

    daemon --ConnectResponse--> _read_stream ---inbox---> step loop (steps.py): at each step
             (peers: kept in a map at once)     ^            boundary apply all, step, push KV,
    peer --KvTransferService.Push---------------+            report
                                                             sim: sleep out step_time_s
    _heartbeats: one heartbeat whenever nothing                model: step() in a thread
    was sent for the interval
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from kvsched import codec
from kvsched.core.errors import ProtocolError
from kvsched.core.protocol import StepReport
from kvsched.v1 import kv_transfer_service_pb2 as kv_pb2
from kvsched.v1 import worker_service_pb2 as pb
from kvsched.worker_stub.channels import open_channel
from kvsched.worker_stub.factories import EngineFactory
from kvsched.worker_stub.guard import DaemonGuard, DaemonSilent, Fenced
from kvsched.worker_stub.kv_push import KvPush
from kvsched.worker_stub.lora import LoraSlots
from kvsched.worker_stub.reconnect import (
    FATAL_CODES,
    Backoff,
    Redirected,
    WorkerError,
    next_server,
    still_attached,
)
from kvsched.worker_stub.stats import WorkerStats
from kvsched.worker_stub.steps import InboxItem, Outbox, StepLoop
from kvsched.worker_stub.storage_kv import reachable_backends

log = logging.getLogger(__name__)

_CONNECT = "/kvsched.v1.WorkerService/Connect"


class Worker(StepLoop):
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
        num_host_blocks: int = 0,
        model: str = "",
        max_model_len: int = 0,
        vocab_size: int = 0,
        structured_outputs: bool = False,
        multimodal: bool = True,
        max_logprobs: int = 0,
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
        give_up_after_s: float = 0.0,
        on_step: Callable[[StepReport], None] | None = None,
        storage_backends: Sequence[str] | None = None,
        lora: LoraSlots | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        stats = WorkerStats()
        kv = KvPush(
            instance_id,
            rank,
            stats,
            channel_credentials=channel_credentials,
            listen=kv_listen,
            server_credentials=kv_server_credentials,
            token=kv_token,
            push_timeout_s=push_timeout_s,
            push_wait_s=push_wait_s,
        )
        super().__init__(
            engine_factory, kv, stats, rank=rank, block_size=block_size, on_step=on_step
        )
        # A comma-separated list of daemons (a cluster): the first is tried first, the next one
        # when a stream cannot be opened or breaks, and a daemon's redirect names the owner.
        self.servers = [a.strip() for a in server.split(",") if a.strip()]
        if not self.servers:
            raise ValueError("server: give at least one daemon address HOST:PORT")
        self.server = self.servers[0]
        self.num_redirects = 0
        self.instance_id = instance_id
        self.world_size = world_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_host_blocks = num_host_blocks  # the host KV tier the engine's executor holds
        self.num_slots = num_slots
        self.model = model  # "": the daemon's configured model
        self.lora = lora or LoraSlots()  # adapters announced in Hello (none by default)
        self.max_loras = self.lora.max_loras  # (StepLoop counts steps over it)
        self.max_model_len = max_model_len  # announced limits (0: not announced)
        self.vocab_size = vocab_size
        self.structured_outputs = structured_outputs  # the executor applies grammars
        self.multimodal = multimodal  # the executor runs requests' multimodal items
        self.max_logprobs = max_logprobs  # Hello.max_logprobs: 0, none (sim, model)
        self.executor_name = executor_name
        # Hello.storage_backends (step 13); None: what this executor can reach
        self.storage_backends = list(
            reachable_backends(executor_name) if storage_backends is None else storage_backends
        )
        self._credentials = channel_credentials
        self._metadata = tuple(metadata)
        self._default_heartbeat_s = heartbeat_interval_s
        self.backoff = Backoff(reconnect_backoff_s, give_up_after_s)  # reconnect.py
        self._stopping = asyncio.Event()
        self._inbox: asyncio.Queue[InboxItem] | None = None
        self._heartbeat_s = heartbeat_interval_s
        self._last_sent = 0.0
        self._welcomed = asyncio.Event()  # set once the current session is welcomed
        # Fencing epoch and the silence bound (protocol steps 12 and 8): guard.py.
        self.guard = DaemonGuard(instance_id)

    @property
    def kv_address(self) -> str | None:
        """host:port peers push to, once run() started the KV server."""
        return self.kv.address

    def stop(self) -> None:
        """Leave: run() closes the stream and returns. Safe to call more than once."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve the daemon until it ends the stream with OK or stop() is called. A broken
        stream is retried with jittered exponential backoff. Raises WorkerError when the daemon
        refuses this worker (FAILED_PRECONDITION, INVALID_ARGUMENT, UNAUTHENTICATED, ...)."""
        kv_server = await self.kv.start_server(self) if self.kv.listen else None
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    if await self._session():
                        if not self._stopping.is_set():
                            log.info("daemon %s ended the stream (OK): leaving", self.server)
                        return
                except grpc.aio.AioRpcError as e:
                    if still_attached(e):
                        # The daemon still holds this rank's previous stream (it has not seen
                        # it break yet: a partition, a pause): it drops it within its
                        # heartbeat timeout, so this is retried with backoff, not fatal.
                        log.warning(
                            "daemon %s: %s; retrying with backoff", self.server, e.details()
                        )
                    elif e.code() in FATAL_CODES:
                        msg = f"daemon refused worker: {e.code().name}: {e.details()}"
                        raise WorkerError(msg) from e
                    elif self._welcomed.is_set():
                        log.warning(
                            "stream to %s broke: %s: %s", self.server, e.code().name, e.details()
                        )
                    else:
                        self.backoff.unreachable(e, self.servers, self.server)
                except Redirected as r:
                    self.num_redirects += 1
                    log.info("redirected from %s to %s: %s", self.server, r.address, r)
                    self.server = r.address
                    if self.num_redirects % 8:  # a redirect loop still backs off, rarely
                        continue
                except DaemonSilent as e:
                    self.guard.num_silent += 1
                    log.warning("leaving daemon %s: %s", self.server, e)
                except Fenced as e:
                    self.guard.num_fenced += 1
                    log.warning("refusing daemon %s: %s", self.server, e)
                except (ProtocolError, ValueError) as e:  # the daemon sent something unusable
                    log.error("dropping the stream to %s: %s", self.server, e)
                self.server = next_server(self.servers, self.server)  # in a cluster
                delay = self.backoff.delay(started)
                quiet = self.backoff.unreachable_since is not None  # said once; not every try
                log.log(
                    logging.DEBUG if quiet else logging.INFO,
                    "reconnecting to %s in %.2f s",
                    self.server,
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
        finally:
            await self._leave_storage()
            await self.kv.close()
            if kv_server is not None:
                await kv_server.stop(grace=0.5)

    # ---- KV pushes this rank receives (the Push servicer calls these) ---------------------------

    async def receive_kv(self, request: kv_pb2.PushRequest) -> tuple[grpc.StatusCode, str]:
        """Queue a received push for the step boundary and wait for its outcome: OK once the
        data is written into the blocks of a held handle."""
        return await self.kv.receive(request, self._inbox)

    def check_kv_auth(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """True when KV pushes need no token or `metadata` carries this worker's."""
        return self.kv.check_auth(metadata)

    # ---- one session ----------------------------------------------------------------------------

    async def _session(self) -> bool:
        """One Connect stream. True when it ended for good: the daemon closed it with OK, or
        stop() was called. Raises when it broke."""
        inbox: asyncio.Queue[InboxItem] = asyncio.Queue()
        outbox: Outbox = asyncio.Queue()
        self._inbox, self._heartbeat_s = inbox, self._default_heartbeat_s
        self._new_session()
        self._welcomed = asyncio.Event()
        self.guard.heard()
        async with open_channel(self.server, self._credentials) as channel:
            # Raw response bytes (no deserializer): the digest covers exactly what was sent.
            connect = channel.stream_stream(
                _CONNECT, request_serializer=pb.ConnectRequest.SerializeToString
            )
            self._send(outbox, pb.ConnectRequest(hello=self._hello()))
            call = connect(_drain(outbox), metadata=self._metadata)
            jobs = [
                asyncio.create_task(self._read_stream(call, inbox)),
                asyncio.create_task(self._serve_steps(inbox, outbox)),
                asyncio.create_task(self._heartbeats(outbox)),
                asyncio.create_task(self.guard.watch_silence(self._welcomed)),
                asyncio.create_task(self._stopping.wait()),
            ]
            try:
                done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                self._inbox = None
                self.kv.fail_pending(inbox)
                outbox.put_nowait(None)  # half-close: the worker leaves
                call.cancel()
        for job in done:
            job.result()  # the first failure, if any
        return True

    def _hello(self) -> pb.Hello:
        return pb.Hello(
            instance_id=self.instance_id,
            rank=self.rank,
            world_size=self.world_size,
            num_gpu_blocks=self.num_gpu_blocks,
            num_host_blocks=self.num_host_blocks,
            block_size=self.block_size,
            num_slots=self.num_slots,
            model=self.model,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_logprobs=self.max_logprobs,
            protocol_version=codec.PROTOCOL_VERSION,
            worker_address=self.kv.address or "",
            executor=self.executor_name,
            storage_backends=self.storage_backends,
            lora_adapters=[pb.LoraAdapter(name=n, path=p) for n, p in self.lora.adapters],
            max_loras=self.lora.max_loras,
            max_cpu_loras=self.lora.max_cpu_loras,
            structured_outputs=self.structured_outputs,
            multimodal=self.multimodal,
        )

    async def _serve_steps(self, inbox: asyncio.Queue[InboxItem], outbox: Outbox) -> None:
        """Wait for the welcome, take its settings, then run the step loop."""
        welcome = await self._welcome(inbox)
        if welcome.protocol_version not in (0, codec.PROTOCOL_VERSION):
            raise WorkerError(
                f"daemon speaks worker protocol {welcome.protocol_version}, "
                f"this worker {codec.PROTOCOL_VERSION}"
            )
        await self._settle_io()  # (the engine is not reset under a running apply)
        engine = self._start_engine(welcome)
        self._welcomed.set()
        self.stats.num_connects += 1  # connects that reached a daemon (welcomed), only
        self.backoff.reached(self.server)
        if welcome.heartbeat_interval_ns:
            self._heartbeat_s = welcome.heartbeat_interval_ns / 1e9
        self.guard.silence_timeout_s = welcome.silence_timeout_ns / 1e9
        log.info(
            "welcomed by %s as %s rank %d/%d: %s",
            self.server,
            self.instance_id,
            self.rank,
            self.world_size,
            self._settings,
        )
        # The store (step 13), heartbeating meanwhile: a store that is down takes seconds.
        suffix = f"@rank{self.rank}" if self.world_size > 1 else ""  # each rank's own shard
        await self._use_storage(engine, welcome.storage_url, suffix)
        await self._step_loop(engine, inbox, outbox)

    def _send(self, outbox: Outbox, msg: pb.ConnectRequest) -> None:
        outbox.put_nowait(msg)
        self._last_sent = time.monotonic()

    async def _read_stream(
        self, call: grpc.aio.StreamStreamCall, inbox: asyncio.Queue[InboxItem]
    ) -> None:
        """Route the daemon's messages until it ends the stream with OK (return) or it breaks
        (AioRpcError)."""
        while (raw := await call.read()) is not grpc.aio.EOF:
            self.guard.heard()
            msg = pb.ConnectResponse.FromString(raw)
            kind = msg.WhichOneof("kind")
            if kind == "tasks":
                self.guard.check_epoch(msg.tasks.fencing_epoch, "Tasks")
                self.stats.num_tasks += 1
                self.stats.tasks_digest = zlib.crc32(raw, self.stats.tasks_digest)
                inbox.put_nowait(codec.tasks_from_proto(msg.tasks))
            elif kind == "welcome":
                self.guard.check_epoch(msg.welcome.fencing_epoch, "Welcome")
                inbox.put_nowait(msg.welcome)
            elif kind == "redirect":
                r = msg.redirect
                raise Redirected(r.address, r.reason or f"owned by daemon {r.owner_daemon_id}")
            elif kind == "peers":
                self.kv.peers = {(p.instance_id, p.rank): p.address for p in msg.peers.peers}
                log.info("KV peers: %s", self.kv.peers)
            # heartbeat: the message itself is the news

    async def _heartbeats(self, outbox: Outbox) -> None:
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


async def _drain(outbox: Outbox) -> AsyncIterator[pb.ConnectRequest]:
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
