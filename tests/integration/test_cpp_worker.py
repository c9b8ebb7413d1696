"""The C++ example worker (examples/cpp_worker) against a real daemon: built with cmake from the
distribution's gRPC C++ and protobuf, it serves hundreds of Generate requests with exactly the
tokens its toy executor produces, and a kill -9 and restart of it under load loses nothing.

Its toy executor's token at (request, position) is the same formula as the Python sim's
(`SimExecutor.token_at`, with the worker's --seed and --eos-every), so the expected outputs here
are computed from that formula, and the stop rules (max_tokens, stop ids, EOS, min_tokens) are
applied to them as the proto says.
"""

from __future__ import annotations

import asyncio
import queue
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.sim import SimExecutor
from tests.integration.clients import Outcome
from tests.integration.harness import REPO, Proc, start_daemon, status, wait_pool_free, wait_ready

SOURCE = REPO / "examples" / "cpp_worker"
BUILD = REPO / "build" / "cpp_worker"  # git-ignored; reused by later runs (cmake rebuilds stale)
TOOLS = ("cmake", "pkg-config", "protoc", "grpc_cpp_plugin", "g++")
PACKAGES = (
    "libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler cmake pkg-config g++"
)
EOS, EOS_EVERY = 2, 16  # the worker's --eos-token-id (default) and --eos-every
TOY = SimExecutor(seed=0, eos_token_id=EOS, eos_every=EOS_EVERY)
LENGTH, STOP = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP


@pytest.fixture(scope="session")
def cpp_worker() -> Path:
    """The built worker binary: a clear failure (not a skip) when the toolchain is missing."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not missing:
        probe = subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], check=False)
        missing = [] if probe.returncode == 0 else ["pkg-config modules grpc++ / protobuf"]
    if missing:
        pytest.fail(f"C++ worker toolchain missing: {missing}; install {PACKAGES} (.ci/run does)")
    for cmd in (
        # No optimisation: a third of the compile time of Release (~20 s of CPU instead of
        # ~50 s, most of it gRPC's headers), and the toy worker's speed does not matter here.
        ["cmake", "-S", str(SOURCE), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=None"],
        ["cmake", "--build", str(BUILD), "-j2"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
        if done.returncode:
            pytest.fail(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return BUILD / "cpp_worker"


class Worker(Proc):
    """The C++ worker as a child process; its log lines are collected like the daemon's."""

    def __init__(self, binary: Path, address: str, *args: str) -> None:
        self.name = "cpp_worker"
        self.popen = subprocess.Popen(
            [str(binary), "--server", address, "--instance", "cpp", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def wait_count(self, pattern: str, n: int, timeout: float) -> None:
        """Wait until `n` output lines match `pattern`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while sum(bool(rx.search(line)) for line in list(self.lines)) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: not {n} lines {pattern!r}:\n{self.output()}")
            time.sleep(0.02)

    def stats(self) -> dict[str, int]:
        """The counters the worker logs when it exits."""
        line = self.wait_for(r"stats: (.*)", timeout=5).group(1)
        return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line)}


@dataclass
class Spec:
    req_id: str
    prompt: list[int]
    max_tokens: int
    stop: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = True

    def message(self) -> rpb.GenerateRequest:
        sampling = common_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop,
            ignore_eos=self.ignore_eos,
        )
        return rpb.GenerateRequest(
            request_id=self.req_id, prompt_token_ids=self.prompt, sampling=sampling
        )

    def expected(self) -> tuple[list[int], int]:
        """The toy model's tokens under the stop rules: length first; EOS (unless ignore_eos)
        and stop ids once min_tokens are out; the stopping token is part of the output."""
        out: list[int] = []
        while True:
            token = TOY.token_at(self.req_id, len(self.prompt) + len(out))
            out.append(token)
            if len(out) >= self.max_tokens:
                return out, LENGTH
            eos = token == EOS and not self.ignore_eos
            if len(out) >= self.min_tokens and (eos or token in self.stop):
                return out, STOP


def mixed_specs(n: int, prefix: str, max_tokens: tuple[int, int], seed: int = 0) -> list[Spec]:
    """Short prompts, varied max_tokens; some stop at a token the model will produce, some at
    EOS, some only after min_tokens."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        spec = Spec(
            f"{prefix}{i}",
            [rng.randrange(3, 30000) for _ in range(rng.randrange(1, 40))],
            rng.randrange(*max_tokens),
        )
        spec.ignore_eos = rng.random() < 0.6
        if rng.random() < 0.3:
            spec.min_tokens = rng.randrange(0, spec.max_tokens + 1)
        if rng.random() < 0.3 and spec.max_tokens > 2:
            plain, _ = Spec(spec.req_id, spec.prompt, spec.max_tokens).expected()
            spec.stop = [plain[rng.randrange(len(plain))]]
        specs.append(spec)
    return specs


async def generate(
    stub: request_service_pb2_grpc.RequestServiceStub, spec: Spec, out: Outcome
) -> None:
    """One Generate stream into `out` (filled as it streams, so a test can look mid-way)."""
    try:
        async for r in stub.Generate(spec.message(), timeout=120):
            kind = r.WhichOneof("kind")
            if kind == "queued":
                out.req_id = r.queued.request_id
            elif kind == "tokens":
                out.tokens.extend(r.tokens.token_ids)
            else:
                assert out.finished is None, f"{spec.req_id}: two finished messages"
                out.finished = r.finished
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code(), exc.details() or ""


def check_outcomes(specs: list[Spec], outcomes: list[Outcome]) -> None:
    for spec, out in zip(specs, outcomes, strict=True):
        assert out.code is None and out.finished is not None, (spec.req_id, out)
        tokens, reason = spec.expected()
        # None lost, none repeated, the worker's own.
        assert out.tokens == tokens, (spec, len(out.tokens), out.finished)
        assert out.finished.reason == reason, (spec, out.finished)


def test_cpp_worker_serves_hundreds_of_requests_with_its_tokens(cpp_worker: Path) -> None:
    # Short heartbeats: the idle stretch at the end shows the worker keeps itself alive.
    env = {"KVSCHED_HEARTBEAT_INTERVAL_S": "0.2", "KVSCHED_HEARTBEAT_TIMEOUT_S": "1.0"}
    daemon, address = start_daemon(env=env)
    # A pool too small for the load: requests wait, get preempted and recomputed.
    worker = Worker(cpp_worker, address, "--num-blocks", "48", "--block-size", "4", "--num-slots", "32",
                    "--eos-every", str(EOS_EVERY), "--step-us", "300")  # fmt: skip
    try:
        wait_ready(address, ["cpp"])
        specs = mixed_specs(300, "cpp-", (1, 64))
        outcomes = [Outcome() for _ in specs]

        async def go() -> None:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                jobs = [generate(stub, s, o) for s, o in zip(specs, outcomes, strict=True)]
                await asyncio.wait_for(asyncio.gather(*jobs), 150)

        asyncio.run(go())
        check_outcomes(specs, outcomes)
        assert {o.finished.reason for o in outcomes if o.finished} == {LENGTH, STOP}
        st = wait_pool_free(address)
        assert st.instances[0].num_preemptions > 0, "the load never preempted: no acks tested"

        # Idle for several heartbeat timeouts: the worker's heartbeats keep the instance in.
        idle_until = time.monotonic() + 2.5
        while time.monotonic() < idle_until:
            inst = status(address, "cpp").instances[0]
            assert inst.ready and inst.num_ranks_connected == 1, inst
            time.sleep(0.1)
        # SIGTERM: the worker ends its stream and exits 0.
        worker.signal(signal.SIGTERM)
        assert worker.wait(15) == 0, worker.output()
        stats = worker.stats()
        assert stats["connects"] == 1, stats
        assert stats["heartbeats"] >= 3, stats
        assert stats["acked"] > 0, stats
        assert stats["tokens"] >= sum(len(o.tokens) for o in outcomes), stats
    finally:
        worker.stop()
        daemon.stop()


def test_kill9_cpp_worker_under_load_then_restart_loses_nothing(cpp_worker: Path) -> None:
    daemon, address = start_daemon()
    args = ("--num-blocks", "1024", "--num-slots", "64", "--step-us", "2000")
    args += ("--eos-every", str(EOS_EVERY))
    worker = Worker(cpp_worker, address, *args)
    try:
        wait_ready(address, ["cpp"])
        specs = mixed_specs(120, "kill-", (60, 200), seed=1)
        outcomes = [Outcome() for _ in specs]

        async def go() -> None:
            nonlocal worker
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                jobs = asyncio.gather(
                    *(generate(stub, s, o) for s, o in zip(specs, outcomes, strict=True))
                )
                # Every request accepted, and some mid-way through their outputs.
                async with asyncio.timeout(30):
                    while not (
                        all(o.req_id for o in outcomes)
                        and sum(bool(o.tokens) for o in outcomes) >= 20
                    ):
                        await asyncio.sleep(0.01)
                in_flight = [o for o in outcomes if o.tokens and o.finished is None]
                worker.signal(signal.SIGKILL)
                worker.wait(10)
                async with asyncio.timeout(10):  # the daemon notices the lost stream
                    while status(address, "cpp").instances[0].num_ranks_connected:
                        await asyncio.sleep(0.02)
                worker = Worker(cpp_worker, address, *args)  # an empty cache, same instance
                await asyncio.wait_for(jobs, 150)
                assert in_flight, "no request was mid-way when the worker died"

        asyncio.run(go())
        daemon.wait_for(r"instance cpp taken out", 5)  # its requests were re-queued
        check_outcomes(specs, outcomes)  # the in-flight ones were re-run: still the formula's
        wait_pool_free(address)
        worker.wait_for(r"welcomed by .* as cpp rank 0/1")
    finally:
        worker.stop()
        daemon.stop()


def test_cpp_worker_reconnects_with_backoff_when_its_instance_is_lost(cpp_worker: Path) -> None:
    """Two C++ ranks of one instance; rank 1 dies. The daemon takes the instance out and tells
    rank 0 (UNAVAILABLE); rank 0 reconnects by itself with an empty cache, and once rank 1 is
    back the instance serves again: the same prompts (the daemon forgot their cached blocks, so
    they are prefilled anew) give the formula's tokens.

    Rank 1 dies while the instance is idle: a rank that dies under load leaves rank 0's last
    reports of the lost stream queued at the daemon, which applies them to the instance's next
    incarnation (see the kill -9 test for requests interrupted mid-way)."""
    daemon, address = start_daemon()
    args = ("--world-size", "2", "--num-blocks", "1024", "--num-slots", "64", "--step-us", "500")
    args += ("--eos-every", str(EOS_EVERY))
    ranks = [Worker(cpp_worker, address, *args, "--rank", str(r)) for r in (0, 1)]

    async def serve(specs: list[Spec]) -> list[Outcome]:
        outcomes = [Outcome() for _ in specs]
        async with grpc.aio.insecure_channel(address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            jobs = (generate(stub, s, o) for s, o in zip(specs, outcomes, strict=True))
            await asyncio.wait_for(asyncio.gather(*jobs), 60)
        return outcomes

    try:
        wait_ready(address, ["cpp"])
        before = mixed_specs(40, "tp-a", (1, 64), seed=2)
        check_outcomes(before, asyncio.run(serve(before)))
        wait_pool_free(address)

        ranks[1].signal(signal.SIGKILL)
        ranks[1].wait(10)
        ranks[0].wait_for(r"stream to .* broke: .*taken out", 10)
        ranks[0].wait_count(r"welcomed by .* as cpp rank 0/2", 2, 15)  # back by itself
        ranks[1] = Worker(cpp_worker, address, *args, "--rank", "1")
        wait_ready(address, ["cpp"])

        after = [Spec(f"tp-b{i}", s.prompt, s.max_tokens, s.stop, s.min_tokens, s.ignore_eos)
                 for i, s in enumerate(before)]  # fmt: skip
        check_outcomes(after, asyncio.run(serve(after)))
        wait_pool_free(address)
        ranks[0].signal(signal.SIGTERM)
        assert ranks[0].wait(15) == 0, ranks[0].output()
        stats = ranks[0].stats()
        assert stats["connects"] == 2 and stats["tokens"] > 0, stats
    finally:
        for r in ranks:
            r.stop()
        daemon.stop()
