"""The daemon in this process, its gRPC server on 127.0.0.1:0, and one in-process `Worker` per
instance running the `model` executor over real loopback channels (as tests/server/
telemetry_harness.py does with the sim). Clients speak RequestService and AdminService.

Every output is checked against `generate_reference` of the same prompt, computed once per
(prompt, max_tokens) with numpy: both backends must produce exactly those tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import grpc
import numpy as np

from kvsched.core import Role
from kvsched.core.protocol import MultimodalRange, StepReport, Tasks
from kvsched.daemon import app as daemon_mod
from kvsched.server.config.load import load_config
from kvsched.server.config.settings import InstanceConfig
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.client import EngineFactory, EngineSettings, Worker, model_engine_factory
from kvsched.worker_stub.engine import KvSender, WorkerEngine
from kvsched.worker_stub.model import ModelConfig, generate_reference

MODEL = ModelConfig()  # what model_engine_factory(seed=0) builds in every worker
TIMEOUT_S = 60.0  # one scenario, end to end: far above what any takes


def make_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, MODEL.vocab_size, size=length).tolist()


Item = tuple[int, int, str]  # a multimodal item: (offset, length, content hash)


@cache
def _reference(
    prompt: tuple[int, ...], max_tokens: int, mm: tuple[Item, ...] = ()
) -> tuple[int, ...]:
    ranges = [MultimodalRange(*m) for m in mm]
    return tuple(generate_reference(MODEL, list(prompt), max_tokens, mm_ranges=ranges))


def reference(prompt: list[int], max_tokens: int, mm: tuple[Item, ...] = ()) -> list[int]:
    """The unpaged numpy run of the same model (its multimodal items encoded afresh): what
    every paged run must produce."""
    return list(_reference(tuple(prompt), max_tokens, mm))


@dataclass(frozen=True, slots=True)
class Node:
    """One instance and its single worker."""

    role: str = "mixed"
    num_gpu_blocks: int = 256
    num_slots: int = 16
    kv_listen: bool = False  # accept KV pushes (a decode instance)
    num_host_blocks: int = 0  # the worker's host-memory KV tier (0: none)


@dataclass(slots=True)
class Result:
    req_id: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    instance: str = ""
    finished: rpb.Finished | None = None
    mm: tuple[Item, ...] = ()

    @property
    def reason(self) -> int:
        assert self.finished is not None, f"{self.req_id}: no Finished"
        return self.finished.reason

    @property
    def expected(self) -> list[int]:
        return reference(self.prompt, self.max_tokens, self.mm)


def generate_request(
    req_id: str, prompt: list[int], max_tokens: int, mm: tuple[Item, ...] = (), **sampling: Any
) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
        mm_ranges=[
            common_pb2.MultimodalRange(offset=o, length=n, content_hash=h) for o, n, h in mm
        ],
    )


class ModelHarness:
    """A running daemon with model workers; `generate` and `status` talk to it over gRPC."""

    def __init__(
        self,
        daemon: daemon_mod.Daemon,
        port: int,
        nodes: dict[str, Node],
        backend: str,
        block_size: int,
    ) -> None:
        self.daemon = daemon
        self.address = f"127.0.0.1:{port}"
        self.nodes = nodes
        self.backend = backend
        self.block_size = block_size
        self.reports: dict[str, list[StepReport]] = {iid: [] for iid in nodes}
        self.applied: dict[str, list[Tasks]] = {iid: [] for iid in nodes}  # Tasks, as applied
        # Called with each engine's executor when a worker session builds it (fault injection).
        self.patch_executor: Callable[[Any], None] | None = None
        self.workers: dict[str, Worker] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = request_service_pb2_grpc.RequestServiceStub(self.channel)
        self.admin = admin_service_pb2_grpc.AdminServiceStub(self.channel)

    # ---- workers --------------------------------------------------------------------------
    def start_worker(self, iid: str) -> Worker:
        node = self.nodes[iid]
        reports = self.reports[iid]
        worker = Worker(
            self.address,
            iid,
            self._factory(iid, node),
            num_gpu_blocks=node.num_gpu_blocks,
            num_host_blocks=node.num_host_blocks,
            block_size=self.block_size,
            num_slots=node.num_slots,
            executor_name="model",
            kv_listen="127.0.0.1:0" if node.kv_listen else None,
            push_wait_s=2.0,
            reconnect_backoff_s=(0.01, 0.05),
            on_step=reports.append,
        )
        self.workers[iid] = worker
        self.tasks[iid] = asyncio.get_running_loop().create_task(worker.run())
        return worker

    def _factory(self, iid: str, node: Node) -> EngineFactory:
        """model_engine_factory, recording every Tasks message the engine applies."""
        base = model_engine_factory(
            node.num_slots,
            node.num_gpu_blocks,
            backend=self.backend,
            num_host_blocks=node.num_host_blocks,
        )
        log = self.applied[iid]

        def build(settings: EngineSettings, kv_sender: KvSender) -> WorkerEngine:
            engine = base(settings, kv_sender)
            if self.patch_executor is not None:
                self.patch_executor(engine.executor)
            apply = engine.apply

            def recorded(tasks: Tasks) -> None:
                log.append(tasks)
                apply(tasks)

            engine.apply = recorded  # type: ignore[method-assign]
            return engine

        return build

    async def stop_worker(self, iid: str) -> None:
        """Stop the worker and wait until it has left (its KV server closed too) and the daemon
        has taken its instance out: until then the daemon may still route a request to it (the
        stream's end reaches the daemon's side a moment after the worker's)."""
        self.workers[iid].stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.tasks[iid], 10.0)
        engine = self.daemon.engines.get(iid)
        if engine is not None:
            await wait_until(lambda: not engine.ready, 10.0, f"instance {iid} taken out")

    async def wait_ready(self, iids: list[str] | None = None, timeout: float = 20.0) -> None:
        want = iids if iids is not None else list(self.nodes)
        await wait_until(
            lambda: all(i in self.daemon.engines and self.daemon.engines[i].ready for i in want),
            timeout,
            f"instances {want} ready",
        )

    # ---- clients ---------------------------------------------------------------------------
    async def generate(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        abort_after: int | None = None,
        mm: tuple[Item, ...] = (),
        **sampling: Any,
    ) -> Result:
        """Run one request through RequestService.Generate; with abort_after, call
        RequestService.Abort once that many tokens have streamed, and read on to Finished.
        mm: its multimodal items (offset, length, content hash)."""
        out = Result(req_id, prompt, max_tokens, mm=mm)
        msg = generate_request(req_id, prompt, max_tokens, mm, **sampling)
        aborted = False
        async for r in self.stub.Generate(msg, timeout=TIMEOUT_S):
            kind = r.WhichOneof("kind")
            if kind == "queued":
                out.instance = r.queued.instance
            elif kind == "tokens":
                out.tokens.extend(r.tokens.token_ids)
            elif kind == "finished":
                out.finished = r.finished
            if abort_after is not None and not aborted and len(out.tokens) >= abort_after:
                aborted = True
                await self.stub.Abort(rpb.AbortRequest(request_id=req_id), timeout=5.0)
        return out

    async def status(self, iid: str) -> apb.InstanceStatus:
        resp = await self.admin.GetStatus(apb.GetStatusRequest(instance_id=iid), timeout=5.0)
        return resp.instances[0]

    async def wait_pool_free(self, iids: list[str] | None = None, timeout: float = 10.0) -> None:
        """Until every instance runs nothing and has all its KV blocks free (read through
        AdminService.GetStatus, as an operator would)."""
        want = iids if iids is not None else list(self.nodes)
        last: list[apb.InstanceStatus] = []

        async def free() -> None:
            nonlocal last
            while True:
                last = [await self.status(i) for i in want]
                if all(
                    s.ready
                    and s.num_free_blocks == s.num_gpu_blocks
                    and s.num_running == s.num_waiting == s.num_slots_used == 0
                    for s in last
                ):
                    return
                await asyncio.sleep(0.02)

        try:
            await asyncio.wait_for(free(), timeout)
        except TimeoutError:
            raise AssertionError(f"KV pool not free / requests left: {last}") from None


async def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@contextlib.asynccontextmanager
async def model_daemon(
    nodes: dict[str, Node] | None = None,
    *,
    backend: str = "numpy",
    block_size: int = 8,
    engine: dict[str, Any] | None = None,
    patch_executor: Callable[[Any], None] | None = None,
    settings: dict[str, Any] | None = None,
) -> AsyncIterator[ModelHarness]:
    """A daemon with one model worker per node. `engine` maps `scheduler.max_num_seqs`-style
    paths (below `engine.`) to values for every instance. Nodes with a role other than mixed
    are configured instances of that role. `settings`: top-level config values (e.g. storage)."""
    nodes = nodes or {"i0": Node()}
    overrides = {f"engine.{k}": v for k, v in (engine or {}).items()}
    config = load_config(
        None,
        {},
        {
            "listen": "127.0.0.1:0",
            "metrics_listen": "",
            "log_level": "warning",
            **(settings or {}),
            **overrides,
        },
    )
    for iid, node in nodes.items():
        if node.role != "mixed":
            inst = InstanceConfig(role=Role(node.role), engine=copy.deepcopy(config.engine))
            config.instances[iid] = inst.validate(iid)
    daemon = daemon_mod.Daemon(config)
    server = daemon_mod.build_server(daemon, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    h = ModelHarness(daemon, port, nodes, backend, block_size)
    h.patch_executor = patch_executor
    # The daemon's watchdog pass, as `serve` runs it: heartbeats to workers it has sent nothing
    # for an interval (a worker leaves a daemon silent past Welcome.silence_timeout_ns), silent
    # workers taken out, queue timeouts and deadlines.
    watch = asyncio.get_running_loop().create_task(daemon.watch(), name="watch")
    try:
        for iid in nodes:
            h.start_worker(iid)
        await h.wait_ready()
        yield h
    finally:
        for iid in list(h.workers):
            await h.stop_worker(iid)
        watch.cancel()
        await h.channel.close()
        await server.stop(None)
        daemon.close_telemetry()


def run(coro: Any, timeout: float = TIMEOUT_S) -> Any:
    """asyncio.run with an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
