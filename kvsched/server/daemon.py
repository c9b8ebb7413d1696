"""The daemon: instances, routing, request tracking, the gRPC server and its shutdown.

A request's daemon-side state is a `Tracked` (stored in `Request.tag`): which instance holds it,
where its outputs go (a sink: one Generate stream or one Session stream), how many tokens that
sink has been sent. Every accepted request ends in exactly one `Finished` delivered to its sink.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import heapq
import logging
import signal
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvsched.core import (
    FinishReason,
    InvalidRequest,
    KvschedError,
    ProtocolError,
    Request,
    RequestNotFound,
    Role,
    Router,
    Unavailable,
)
from kvsched.core.request import FINISHED_STATUS
from kvsched.server import convert
from kvsched.server.engine import InstanceEngine, RankConn
from kvsched.server.telemetry import make_telemetry
from kvsched.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    request_service_pb2,
    request_service_pb2_grpc,
    worker_service_pb2,
)

if TYPE_CHECKING:
    from kvsched.server.config import ServerConfig

log = logging.getLogger("kvsched.daemon")

MAX_GPU_BLOCKS = 1 << 22  # 4M blocks; a pool this big takes ~1 s and ~1 GB to set up
RECENT_FINISHED = 10_000  # ids remembered so a late Abort of a finished request is a no-op

SERVICE_NAMES = (
    request_service_pb2.DESCRIPTOR.services_by_name["RequestService"].full_name,
    worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
    admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


class Sink(Protocol):
    """Where a request's outputs go. `notify`: it has news (it finished); `add_tokens`: new
    output tokens of several requests, in order, each request at most once: trs[i] produced
    counts[i] tokens (counts None: one each), consecutive in toks."""

    def notify(self, tr: Tracked) -> None: ...

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int]) -> None: ...


@dataclass(slots=True, eq=False)
class Tracked:
    req: Request  # the current core request (a decode instance's copy after hand-off)
    engine: InstanceEngine
    sink: Sink
    detachable: bool = False
    owner: str = ""
    client_tag: str = ""
    sent: int = 0  # output tokens handed to the sink
    decode_engine: InstanceEngine | None = None  # P/D: holds a reservation until hand-off
    span: Any = None


class Daemon:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engines: dict[str, InstanceEngine] = {}
        self.tracked: dict[str, Tracked] = {}
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.router = Router()
        self.draining = False
        self.paused = False
        self.telemetry = make_telemetry(config, self)
        self.health = HealthServicer()
        self.all_done = asyncio.Event()
        self.orphans: list[tuple[Tracked, float, str]] = []  # lost instance, deadline, why
        self.timers: list[tuple[float, int, Tracked, str]] = []  # heap: when, seq, request, kind
        self._timer_seq = 0
        self.streams: set[Any] = set()  # open Generate / Session sinks (stall watchdog)
        self.num_requeued = 0
        for iid, icfg in config.instances.items():
            self.engines[iid] = InstanceEngine(self, iid, icfg.engine, icfg.world_size)

    # ---- workers ----------------------------------------------------------------------------
    def attach_worker(self, hello: Any) -> tuple[InstanceEngine, RankConn]:
        """Register a worker rank from its Hello; raises ProtocolError for a bad one."""
        if hello.protocol_version != convert.PROTOCOL_VERSION:
            raise ProtocolError(
                f"worker speaks protocol version {hello.protocol_version}; this daemon speaks "
                f"{convert.PROTOCOL_VERSION}"
            )
        if not hello.instance_id:
            raise ProtocolError("Hello.instance_id must not be empty")
        for name, value, hi in (
            ("num_gpu_blocks", hello.num_gpu_blocks, MAX_GPU_BLOCKS),
            ("block_size", hello.block_size, 4096),
            ("num_slots", hello.num_slots, (1 << 32) - 1),  # min()ed with max_num_seqs
        ):
            if not 1 <= value <= hi:
                raise ProtocolError(f"Hello.{name} = {value} is out of range [1, {hi}]")
        if not 0 <= hello.rank < max(1, hello.world_size) <= 64:
            raise ProtocolError(
                f"Hello.rank = {hello.rank} is outside world size {hello.world_size} (ranks 0..world_size-1), "
                "world_size at most 64"
            )
        eng = self.engines.get(hello.instance_id)
        if eng is None:
            if not self.config.auto_instances:
                raise ProtocolError(
                    f"unknown instance {hello.instance_id!r}; configured: {sorted(self.engines)}"
                )
            engine_config = copy.deepcopy(self.config.engine)
            eng = InstanceEngine(self, hello.instance_id, engine_config, max(1, hello.world_size))
            self.engines[hello.instance_id] = eng
        conn = RankConn(
            rank=hello.rank,
            num_gpu_blocks=hello.num_gpu_blocks,
            block_size=hello.block_size,
            num_slots=hello.num_slots,
            address=hello.worker_address,
            model=hello.model,
        )
        try:
            eng.attach(conn, max(1, hello.world_size))
        except Exception:
            if (
                not eng.ranks
                and eng.sched is None
                and hello.instance_id not in self.config.instances
            ):
                del self.engines[hello.instance_id]  # refused before it ever existed
            raise
        return eng, conn

    def welcome(self, eng: InstanceEngine, conn: RankConn) -> bytes:
        cfg = eng.engine_config
        msg = worker_service_pb2.ConnectResponse(
            welcome=worker_service_pb2.Welcome(
                protocol_version=convert.PROTOCOL_VERSION,
                instance_id=eng.instance_id,
                block_size=conn.block_size,
                num_speculative_tokens=cfg.speculative.num_speculative_tokens,
                max_model_len=cfg.scheduler.max_model_len,
                role=convert.role_to_proto(eng.role),
                heartbeat_interval_ns=int(self.config.heartbeat_interval_s * 1e9),
                answers_reports=True,
            )
        )
        return msg.SerializeToString()

    def on_instance_ready(self, eng: InstanceEngine) -> None:
        """Place requests waiting for an instance; tell every worker where the KV receivers
        are (prefill workers push to them)."""
        self._place_orphans()
        peers = [p for e in self.engines.values() for p in e.peers()]
        if not peers:
            return
        msg = worker_service_pb2.ConnectResponse(
            peers=worker_service_pb2.Peers(
                peers=[
                    worker_service_pb2.Peers.Peer(instance_id=i, rank=r, address=a)
                    for i, r, a in peers
                ]
            )
        ).SerializeToString()
        for e in self.engines.values():
            for conn in e.ranks.values():
                conn.queue.put_nowait(msg)

    # ---- requests ---------------------------------------------------------------------------
    def submit(
        self,
        pb: request_service_pb2.GenerateRequest,
        sink: Sink,
        owner: str = "",
        client_tag: str = "",
        carrier: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
    ) -> Tracked:
        """Validate, route and queue one request. Raises a typed error (nothing is kept) or
        returns its Tracked state; from then on the sink gets exactly one Finished."""
        if self.draining:
            raise Unavailable("kvsched is draining (shutting down): not accepting new requests")
        if pb.model and pb.model != self.config.model:
            raise InvalidRequest(
                f"unknown model {pb.model!r}; this daemon serves {self.config.model!r}"
            )
        req_id = pb.request_id or uuid.uuid4().hex
        if req_id in self.tracked:
            raise InvalidRequest(f"request_id {req_id!r} is already in use by a live request")
        req = convert.request_from_proto(pb, req_id, time.monotonic())
        ready = [e for e in self.engines.values() if e.accepting and not e.is_decode]
        if not ready:
            raise Unavailable(
                "no instance is ready: no worker connected (start one with `kvsched worker`), "
                "or all are draining or paused"
            )
        scheds = [e.sched for e in ready]
        eng = ready[self.router.pick(scheds, req) if len(ready) > 1 else 0]  # type: ignore[arg-type]
        tr = Tracked(req, eng, sink, pb.detachable, owner, client_tag)
        if eng.role == Role.PREFILL:
            tr.decode_engine = self._reserve_decode(req)
        assert eng.sched is not None
        try:
            eng.sched.add_request(req)
        except Exception:
            self._cancel_reservation(tr)
            raise
        req.tag = tr
        self.tracked[req_id] = tr
        self.all_done.clear()
        now = time.monotonic()
        if self.config.queue_timeout_s > 0:
            self._timer(now + self.config.queue_timeout_s, tr, "queue")
        if deadline_s is not None:
            self._timer(now + deadline_s, tr, "deadline")
        self.telemetry.request_accepted(tr, carrier or {})
        eng.wake()
        return tr

    def _reserve_decode(self, req: Request) -> InstanceEngine:
        decodes = [e for e in self.engines.values() if e.is_decode and e.accepting]
        if not decodes:
            raise Unavailable("prefill instance has no ready decode instance to hand off to")
        idx = self.router.pick_decode([e.sched for e in decodes])  # type: ignore[misc]
        d = decodes[idx or 0]
        assert d.sched is not None
        got = d.sched.preallocate(req)
        if got is None:
            raise Unavailable(
                f"decode instance {d.instance_id} has no free slot or blocks for this request now; retry"
            )
        handle, blocks = got
        req.kv_target = (d.instance_id, handle, blocks)
        d.wake()
        return d

    def _cancel_reservation(self, tr: Tracked) -> None:
        d, tr.decode_engine = tr.decode_engine, None
        if d is not None and d.sched is not None:
            try:
                d.sched.abort(tr.req.req_id, FinishReason.ABORT, "prefill ended")
            except RequestNotFound:
                return
            d.wake()

    def abort(
        self, req_id: str, message: str = "aborted by client", owner: str | None = None
    ) -> None:
        """Abort a live request by id; a recently finished one is a no-op (an abort and a finish
        may cross). RequestNotFound otherwise, or when `owner` did not submit it."""
        tr = self.tracked.get(req_id)
        if tr is None:
            if req_id in self.recent:
                return
            raise RequestNotFound(
                f"no live request with id {req_id!r} (never submitted, or finished long ago)"
            )
        if owner is not None and tr.owner != owner:
            raise RequestNotFound(
                f"no live request with id {req_id!r} submitted with your credentials"
            )
        self.abort_tracked(tr, message)

    def abort_tracked(
        self, tr: Tracked, message: str, reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self._cancel_reservation(tr)
        sched = tr.engine.sched
        if sched is None or sched.requests.get(tr.req.req_id) is not tr.req:
            self._fail(tr, message, reason)  # orphaned: waiting for an instance
            return
        sched.abort(tr.req.req_id, reason, message)
        tr.engine.wake()

    def on_handed_off(self, p: InstanceEngine, req: Request) -> None:
        tr = req.tag
        if not isinstance(tr, Tracked):
            return
        d, tr.decode_engine = tr.decode_engine, None
        if d is None or d.sched is None:
            self._fail(tr, "decode instance lost before hand-off")
            return
        try:
            dreq = d.sched.add_prefilled(req.req_id, req.output_token_ids, req.num_cached_tokens)
        except RequestNotFound:
            self._fail(tr, "decode reservation gone before hand-off")
            return
        dreq.tag = tr
        dreq.arrival_time, dreq.first_token_time = req.arrival_time, req.first_token_time
        dreq.first_scheduled_time = req.first_scheduled_time
        dreq.num_cached_tokens = req.num_cached_tokens
        tr.req, tr.engine = dreq, d
        d.wake()

    def on_finished(self, eng: InstanceEngine, req: Request) -> None:
        tr = req.tag
        if not isinstance(tr, Tracked) or tr.req is not req:
            return  # a decode reservation or a stale copy
        self._cancel_reservation(tr)
        if self.tracked.pop(req.req_id, None) is None:
            return
        self.recent[req.req_id] = None
        if len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)
        self.telemetry.request_finished(tr)
        tr.sink.notify(tr)
        if not self.tracked:
            self.all_done.set()

    # ---- lost instances -----------------------------------------------------------------------
    def requeue_lost(self, old: Request, reason: str) -> None:
        """A live request of a lost instance: keep the tokens it streamed and recompute it on
        another instance (or the same one once it reconnects), within requeue_timeout_s."""
        tr = old.tag
        if not isinstance(tr, Tracked) or tr.req is not old:
            return  # a decode reservation: its prefill side fails the hand-off
        if tr.decode_engine is not None or tr.engine.role != Role.MIXED:
            self._fail(tr, f"{reason}; disaggregated requests are not moved")
            return
        new = Request(
            old.req_id,
            old.prompt_token_ids,
            old.sampling,
            old.priority,
            old.arrival_time,
            old.lora_name,
            old.cache_salt,
            old.mm_ranges,
        )
        new.output_token_ids = list(old.output_token_ids)
        new.num_cached_tokens = old.num_cached_tokens
        new.num_preemptions = old.num_preemptions
        new.first_scheduled_time, new.first_token_time = (
            old.first_scheduled_time,
            old.first_token_time,
        )
        new.tag = tr
        tr.req = new
        self.telemetry.request_moved(tr, reason)
        self.num_requeued += 1
        self.orphans.append((tr, time.monotonic() + self.config.requeue_timeout_s, reason))
        self._place_orphans()

    def _place_orphans(self) -> None:
        """Route requests whose instance was lost; fail those past their deadline."""
        now, keep = time.monotonic(), []
        for tr, deadline, reason in self.orphans:
            if self.tracked.get(tr.req.req_id) is not tr:
                continue  # aborted meanwhile
            ready = [e for e in self.engines.values() if e.accepting and e.role == Role.MIXED]
            if ready:
                eng = ready[self.router.pick([e.sched for e in ready], tr.req)]  # type: ignore[misc]
                assert eng.sched is not None
                try:
                    eng.sched.add_request(tr.req)
                except KvschedError as exc:
                    self._fail(tr, f"{reason}; cannot move to {eng.instance_id}: {exc}")
                    continue
                tr.engine = eng
                eng.wake()
            elif now >= deadline:
                self._fail(
                    tr,
                    f"unavailable: {reason}; no instance could take the request within "
                    f"{self.config.requeue_timeout_s:g} s",
                )
            else:
                keep.append((tr, deadline, reason))
        self.orphans = keep

    def _fail(self, tr: Tracked, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        """End a request no scheduler holds (orphaned, hand-off failed)."""
        req = tr.req
        req.status = FINISHED_STATUS[reason]
        req.finish_reason, req.finish_message = reason, message
        req.finished_time = time.monotonic()
        self.on_finished(tr.engine, req)

    def _timer(self, when: float, tr: Tracked, kind: str) -> None:
        self._timer_seq += 1
        heapq.heappush(self.timers, (when, self._timer_seq, tr, kind))

    def _expire(self, now: float) -> None:
        """Queue timeouts and deadlines that have passed (a heap: O(expired) per tick)."""
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, tr, kind = heapq.heappop(timers)
            if self.tracked.get(tr.req.req_id) is not tr:
                continue
            if kind == "deadline":
                self.abort_tracked(tr, "deadline exceeded (the call's gRPC deadline passed)")
            elif tr.req.first_scheduled_time < 0:
                self.abort_tracked(
                    tr, f"queue timeout: not scheduled within {self.config.queue_timeout_s:g} s"
                )

    def _cut_stalled(self, now: float) -> None:
        limit = self.config.stall_timeout_s
        for sink in list(self.streams):
            since = sink.pending_since
            if since is not None and now - since > limit and sink.task is not None:
                log.warning("cutting a stream that has not read its outputs for %.1f s", limit)
                sink.stalled = True
                self.streams.discard(sink)
                sink.task.cancel()

    async def watch(self) -> None:
        """Take out instances whose workers went silent; expire orphaned requests, queue
        timeouts and deadlines; cut streams whose clients stopped reading."""
        cfg = self.config
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            self._expire(now)
            self._cut_stalled(now)
            for eng in list(self.engines.values()):
                silent = [
                    c for c in eng.ranks.values() if now - c.last_seen > cfg.heartbeat_timeout_s
                ]
                if silent:
                    eng.take_out(
                        f"rank {silent[0].rank} silent for more than {cfg.heartbeat_timeout_s:g} s",
                        ProtocolError("heartbeat timeout: no message within heartbeat_timeout_s"),
                    )
            if self.orphans:
                self._place_orphans()

    # ---- admin ------------------------------------------------------------------------------
    def select(self, instance_id: str) -> list[InstanceEngine]:
        if not instance_id:
            return list(self.engines.values())
        eng = self.engines.get(instance_id)
        if eng is None:
            raise RequestNotFound(f"no instance {instance_id!r}; known: {sorted(self.engines)}")
        return [eng]

    # ---- shutdown ---------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish within `grace_s`, abort the rest."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d request(s) in flight, grace %.1f s", len(self.tracked), grace_s)
        if self.tracked:
            try:
                await asyncio.wait_for(self.all_done.wait(), grace_s)
            except TimeoutError:
                for tr in list(self.tracked.values()):
                    self.abort_tracked(tr, "daemon shutting down: grace period over")
                try:
                    await asyncio.wait_for(self.all_done.wait(), 5.0)
                except TimeoutError:
                    log.error("%d request(s) did not finish after abort", len(self.tracked))


def build_server(daemon: Daemon, config: ServerConfig) -> grpc.aio.Server:
    from kvsched.server.admin import AdminServicer
    from kvsched.server.auth import AuthInterceptor, load_auth_file
    from kvsched.server.errors import ErrorInterceptor
    from kvsched.server.frontend import RequestServicer
    from kvsched.server.workers import worker_service_handler

    mb = config.max_message_bytes
    options = [
        ("grpc.max_send_message_length", mb),
        ("grpc.max_receive_message_length", mb),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),  # a second daemon on the same port must fail, not share it
    ]
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
    auth_file = config.auth_file
    if auth_file:
        interceptors.append(AuthInterceptor(load_auth_file(auth_file)))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    request_service_pb2_grpc.add_RequestServiceServicer_to_server(RequestServicer(daemon), server)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(daemon), server)
    server.add_generic_rpc_handlers((worker_service_handler(daemon),))
    health_pb2_grpc.add_HealthServicer_to_server(daemon.health, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    return server


def _hostport(listen: str, port: int) -> str:
    from kvsched.server.config import split_host_port

    if listen.startswith("unix:"):
        return listen
    host = split_host_port(listen)[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Listen on config.listen, with TLS (and client certificates) when configured. Raises
    ConfigError for unusable TLS files, Unavailable when the address cannot be bound."""
    try:
        if not config.tls_cert:
            return int(server.add_insecure_port(config.listen))
        creds = _server_credentials(config)
        return int(server.add_secure_port(config.listen, creds))
    except RuntimeError as exc:  # grpc raises instead of returning 0 since 1.60
        raise Unavailable(f"cannot listen on {config.listen}: {exc}") from None


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS credentials from the configured PEM files, checked first with the ssl module: grpc
    reports a bad certificate, a key that does not match it, or a bad CA file only as "Failed
    to bind to address"."""
    import ssl
    from pathlib import Path

    from kvsched.core import ConfigError

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"tls_cert = {config.tls_cert!r} / tls_key = {config.tls_key!r}: not a PEM "
            f"certificate and the private key that matches it ({exc})"
        ) from None
    ca = None
    if config.tls_client_ca:
        try:
            ctx.load_verify_locations(cafile=config.tls_client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls_client_ca = {config.tls_client_ca!r}: not a PEM CA certificate ({exc})"
            ) from None
        ca = Path(config.tls_client_ca).read_bytes()
    key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> int:
    daemon = Daemon(config)
    server = build_server(daemon, config)
    port = bind(server, config)
    if port == 0:
        raise Unavailable(f"cannot listen on {config.listen}")
    metrics_port = await daemon.telemetry.start_metrics_server()
    await server.start()
    await daemon.health.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"kvsched listening on {_hostport(config.listen, port)}", flush=True)
    if metrics_port is not None:
        print(f"kvsched metrics on {_hostport(config.metrics_listen, metrics_port)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    watcher = loop.create_task(daemon.watch(), name="watch")
    await stop.wait()
    log.info("signal received: draining")
    await daemon.drain(config.grace_period_s)
    watcher.cancel()
    await server.stop(grace=1.0)
    daemon.telemetry.shutdown()
    log.info("stopped")
    return 0


def run_server(config: ServerConfig) -> int:
    try:
        return asyncio.run(serve(config))
    except Unavailable as exc:
        print(f"kvsched: {exc}", file=sys.stderr)
        return 2
