"""The composition root: builds the daemon's parts, wires them, serves, and shuts down.

    config ─> Daemon: telemetry, InstanceRegistry (engines), RequestTable (engine listener)
           ─> build_server: interceptors (errors, auth), servicers (request, admin, worker),
              health, reflection ─> bind (TLS when configured) ─> serve: watchdog, signals,
              drain

Nothing below imports this module: each servicer is given the parts it uses.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvsched import event_loop, heap
from kvsched.core import Unavailable
from kvsched.server.admin import AdminServicer
from kvsched.server.auth import AuthInterceptor, load_auth_file
from kvsched.server.config.settings import split_host_port
from kvsched.server.errors import ErrorInterceptor
from kvsched.server.instances.engine import InstanceEngine
from kvsched.server.instances.registry import InstanceRegistry
from kvsched.server.instances.workers import worker_service_handler
from kvsched.server.requests.accept import Acceptor
from kvsched.server.requests.durable import Durability
from kvsched.server.requests.frontend import RequestServicer
from kvsched.server.requests.record import Tracked
from kvsched.server.requests.resume import Resumer
from kvsched.server.requests.table import RequestTable
from kvsched.server.telemetry.hooks import make_telemetry
from kvsched.server.telemetry.values import ClusterFacts
from kvsched.tls import server_credentials
from kvsched.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    request_service_pb2,
    request_service_pb2_grpc,
    worker_service_pb2,
)

if TYPE_CHECKING:
    from kvsched.cluster.link import ClusterLink
    from kvsched.cluster.node import ClusterNode
    from kvsched.server.config.settings import ServerConfig

log = logging.getLogger("kvsched.daemon")

SERVICE_NAMES = (
    request_service_pb2.DESCRIPTOR.services_by_name["RequestService"].full_name,
    worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
    admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


class Daemon:
    """The daemon's parts, wired. Construct inside a running event loop (engines start their
    loops at once)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Telemetry is handed values: each engine step's (`StepStats`), and at scrape time the
        # instances' published facts (the registry's) and the cluster's (once joined).
        self.telemetry = make_telemetry(config)
        self.health = HealthServicer()
        self.registry = InstanceRegistry(config, self.telemetry)
        self.telemetry.read_facts_from(self.registry.instance_facts, self.cluster_facts)
        self.requests = RequestTable(config, self.registry, self.telemetry)
        self.registry.open(self.requests)
        # The journal glue (a lifecycle observer once `open_journal` hands it the journal, in
        # a cluster); accepting (route, send, journal) and the ways back (recover, Resume).
        self.durable = Durability(self.requests)
        self.acceptor = Acceptor(self.requests, self.registry, config, self.durable)
        self.resumer = Resumer(self.requests, self.durable)
        # The NATS connection when this daemon is in a cluster, and its membership, leases,
        # KV events, routing and forwarding (set by `join_cluster`).
        self.cluster_link: ClusterLink | None = None
        self.cluster_node: ClusterNode | None = None
        self.journal_task: asyncio.Task[None] | None = None

    def close_telemetry(self) -> None:
        """End the spans of the requests still tracked, flush the exporters, stop /metrics."""
        self.telemetry.shutdown(list(self.requests.tracked.values()))

    def cluster_facts(self) -> ClusterFacts | None:
        """This daemon's cluster figures for a scrape (None: not in a cluster)."""
        node = self.cluster_node
        if node is None:
            return None
        return ClusterFacts(node.daemon_id, node.link.url, node.cluster_status())

    async def join_cluster(self, advertise: str) -> None:
        """Connect to the cluster's NATS when `cluster` is configured. Unreachable: raise
        `Unavailable`, or with `cluster_fallback = "standalone"` log it and run alone."""
        config = self.config
        if not config.cluster:
            return
        from kvsched.cluster.link import connect_cluster

        daemon_id = config.daemon_id or advertise.replace(":", "-").replace(".", "-")
        try:
            self.cluster_link = await connect_cluster(config.cluster, daemon_id)
        except Unavailable as exc:
            if config.cluster_fallback != "standalone":
                raise
            log.warning("%s; running standalone (cluster_fallback = standalone)", exc)
            return
        from kvsched.cluster.node import ClusterNode

        self.cluster_node = ClusterNode(
            config, self.cluster_link, self.registry, self.requests, advertise
        )
        await self.cluster_node.start()
        # Its forwarder cancels the relays of requests that end here first.
        self.requests.observers.observe(self.cluster_node.forwarder)
        log.info("joined cluster %s as daemon %s", config.cluster, daemon_id)
        if config.journal:
            await self.open_journal(self.cluster_link)
        from kvsched.cluster.takeover import Takeover

        # A peer whose membership expires: its instances and unfinished requests come here
        # when this daemon wins their leases (without a journal: the instances only).
        self.cluster_node.fence.durable = self.durable  # parks and looks up journaled requests
        if config.journal:  # a forwarded request a peer refused is journaled here meanwhile
            self.cluster_node.forwarder.use_journal(self.durable)
        takeover = self.cluster_node.takeover = Takeover(self.cluster_node, self.resumer.recover)
        if config.take_over:  # by hand: the operator says it is dead; its leases come here too
            dead = config.take_over
            try:
                _, taken = await takeover.take_over(dead, (), force=True)
            except Exception as exc:
                raise Unavailable(
                    f"cannot take over daemon {dead!r} ({type(exc).__name__}: {exc})"
                ) from None
            print(f"kvsched took over {taken} request(s) of daemon {dead}", flush=True)
        takeover.start()

    async def open_journal(self, link: ClusterLink) -> None:
        """Open the journal, park this daemon's unfinished requests from it (placed when
        their instances' workers connect), then journal every new request."""
        from kvsched.durability.journal import Journal

        config = self.config
        journal = Journal(
            link,
            flush_ms=config.journal_flush_ms,
            timeout_s=config.journal_timeout_s,
            max_age_s=config.journal_max_age_s,
            max_bytes=config.journal_max_bytes,
        )
        try:
            await journal.open()
            self.durable.use(journal)
            n = await self.resumer.recover()
        except Unavailable:
            raise
        except Exception as exc:
            raise Unavailable(
                f"cannot open or read the request journal on {link.url} "
                f"({type(exc).__name__}: {exc})"
            ) from None
        if n:
            print(f"kvsched recovered {n} request(s) from the journal", flush=True)
        requests = self.requests
        self.journal_task = asyncio.get_running_loop().create_task(
            journal.run(lambda: requests.tracked.values()), name="journal"
        )

    @property
    def engines(self) -> dict[str, InstanceEngine]:
        """The instances' engines (owned by the registry)."""
        return self.registry.engines

    @property
    def tracked(self) -> dict[str, Tracked]:
        """The live requests by id (owned by the request table)."""
        return self.requests.tracked

    async def watch(self) -> None:
        """Take out instances whose workers went silent and send heartbeats to those the
        daemon has been silent to; place parked requests or expire them, queue timeouts and deadlines; cut
        streams whose clients stopped reading."""
        requests, registry = self.requests, self.registry
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            requests.watchdog.tick(now)  # first: a pause this daemon stood still is seen at once
            requests.expire(now)
            requests.watchdog.cut_stalled(now)
            registry.take_out_silent(now)
            registry.send_heartbeats(now)
            registry.forget_lost(now)
            if requests.parked:
                requests.place_parked()

    async def drain(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish within `grace_s`, abort the rest."""
        requests = self.requests
        requests.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d request(s) in flight, grace %.1f s", len(requests.tracked), grace_s)
        if requests.tracked:
            try:
                await asyncio.wait_for(requests.all_done.wait(), grace_s)
            except TimeoutError:
                requests.abort_all("daemon shutting down: grace period over")
                try:
                    await asyncio.wait_for(requests.all_done.wait(), 5.0)
                except TimeoutError:
                    log.error("%d request(s) did not finish after abort", len(requests.tracked))


def build_server(daemon: Daemon, config: ServerConfig) -> grpc.aio.Server:
    receive = config.receive_message_bytes()
    options = [
        ("grpc.max_send_message_length", config.send_message_bytes()),
        ("grpc.max_receive_message_length", receive),
        # A stream's receive window stays the largest valid request (no BDP growth): a client
        # sending a far larger one has at most that much in flight when the call is refused,
        # instead of the many MB a grown window lets in per refusal (bench/refusal_rss.py).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", receive),
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
    requests, registry = daemon.requests, daemon.registry
    # grpc_tools generates the *_pb2_grpc modules without annotations (no stubs to check).
    front = RequestServicer(
        daemon.acceptor,
        daemon.resumer,
        daemon.durable,
        daemon.requests,
        config.max_session_requests,
        max_message_bytes=receive,
    )
    request_service_pb2_grpc.add_RequestServiceServicer_to_server(  # type: ignore[no-untyped-call]
        front, server
    )
    gateway = add_gateway_service(front, config, server)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(  # type: ignore[no-untyped-call]
        AdminServicer(registry, requests), server
    )
    server.add_generic_rpc_handlers((worker_service_handler(registry),))
    health_pb2_grpc.add_HealthServicer_to_server(daemon.health, server)
    reflection.enable_server_reflection(SERVICE_NAMES + gateway, server)
    return server


def add_gateway_service(
    front: RequestServicer, config: ServerConfig, server: grpc.aio.Server
) -> tuple[str, ...]:
    """The engine protocol a gateway speaks (smg's `vllm.grpc.engine.VllmEngine`,
    server/gateway/), beside RequestService and through it, when the `gateway` extra
    (smg-grpc-proto) is installed; without it the daemon serves its own services only."""
    try:
        from kvsched.server.gateway.servicer import add_to_server
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "smg_grpc_proto":
            raise
        log.debug("smg-grpc-proto not installed: no gateway engine protocol")
        return ()
    return (add_to_server(front, config.tokenizer, server),)


def _hostport(listen: str, port: int) -> str:
    if listen.startswith("unix:"):
        return listen
    host = split_host_port(listen)[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_free(listen: str) -> None:
    """Unavailable, in one line, when a TCP address is taken: said before gRPC's own log noise
    (it prints its bind failure first). A free port is closed again at once; gRPC binds it."""
    if listen.startswith("unix:"):
        return
    host, port = split_host_port(listen)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise Unavailable(
                    f"cannot listen on {listen}: address already in use (another kvsched "
                    "serve, or another program, holds it; choose another with --listen)"
                ) from None
            # Anything else (a name that does not resolve, ...): gRPC's own error says it.


def bind(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Listen on config.listen, with TLS (and client certificates) when configured. Raises
    ConfigError for unusable TLS files, Unavailable when the address cannot be bound."""
    _check_free(config.listen)
    try:
        if not config.tls_cert:
            return int(server.add_insecure_port(config.listen))
        creds = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        return int(server.add_secure_port(config.listen, creds))
    except RuntimeError as exc:  # grpc raises instead of returning 0 since 1.60
        raise Unavailable(f"cannot listen on {config.listen}: {exc}") from None


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> int:
    daemon = Daemon(config)
    server = build_server(daemon, config)
    port = bind(server, config)
    if port == 0:
        raise Unavailable(f"cannot listen on {config.listen}")
    await daemon.join_cluster(config.advertise or _hostport(config.listen, port))
    metrics_port = await daemon.telemetry.start_metrics_server()
    await server.start()
    await daemon.health.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before "listening": a SIGTERM after it drains
        loop.add_signal_handler(sig, stop.set)
    heap.freeze_after_start()
    log.info("event loop: %s", event_loop.name())
    print(f"kvsched listening on {_hostport(config.listen, port)}", flush=True)
    if metrics_port is not None:
        print(f"kvsched metrics on {_hostport(config.metrics_listen, metrics_port)}", flush=True)
    if ready is not None:
        ready.set()
    watcher = loop.create_task(daemon.watch(), name="watch")
    await stop.wait()
    log.info("signal received: draining")
    await daemon.drain(config.grace_period_s)
    watcher.cancel()
    if daemon.cluster_node is not None:  # leases released: workers find the next owner
        # Bounded without waiting on a cancellation (a NATS watcher may never finish one):
        # a daemon that cannot leave cleanly still exits; its entries then expire by TTL.
        leaving = loop.create_task(daemon.cluster_node.stop(), name="cluster-stop")
        _, pending = await asyncio.wait({leaving}, timeout=5.0)
        if pending:
            log.warning("leaving the cluster took over 5 s: exiting anyway (entries expire)")
    await server.stop(grace=1.0)
    if daemon.journal_task is not None:
        journal = daemon.durable.journal
        if journal is not None:
            await journal.close(daemon.requests.tracked.values())
        daemon.journal_task.cancel()
    if daemon.cluster_link is not None:
        await daemon.cluster_link.close()
    daemon.close_telemetry()
    log.info("stopped")
    return 0


def run_server(config: ServerConfig) -> int:
    try:
        loop_factory = event_loop.factory()
    except ValueError as exc:
        print(f"kvsched: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(serve(config))
    except Unavailable as exc:
        print(f"kvsched: {exc}", file=sys.stderr)
        return 2
