"""What the fuzz tests drive a long-lived daemon with: an event loop in a thread (hypothesis runs
examples synchronously; the gRPC channel and the background traffic live on this loop), well-formed
background traffic whose outputs are checked token by token, a hand-driven worker stream, and the
oracles: what the daemon must answer to a GenerateRequest, and what the sim worker produces."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvsched.v1 import common_pb2, request_service_pb2_grpc, worker_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.v1 import worker_service_pb2 as wpb
from tests.integration.clients import SIM, Outcome, Spec, generate

T = TypeVar("T")

# The daemon's defaults (kvsched.core.config / protocol), which the oracle mirrors.
MAX_MODEL_LEN = 131072
DEFAULT_MAX_TOKENS = 16
MODEL = "default"
VOCAB_SIZE = 32000  # the sim worker's, announced in its Hello
STOP, LENGTH, ABORT = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORT,
)


class LoopThread:
    """An asyncio loop running in a daemon thread; `run` waits for a coroutine with a timeout,
    so a hang in the daemon fails the example instead of the session."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no answer within {timeout} s: the daemon hangs") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def within(awaitable: Awaitable[T], timeout: float, what: str) -> T:
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise AssertionError(f"{what}: nothing within {timeout} s") from None


# ---- the sim worker's outputs ---------------------------------------------------------------


def effective_max_tokens(sp: common_pb2.SamplingParams) -> int:
    return sp.max_tokens if sp.HasField("max_tokens") else DEFAULT_MAX_TOKENS


def sim_output(req_id: str, msg: rpb.GenerateRequest) -> tuple[list[int], int]:
    """The tokens and finish reason the sim worker produces for an accepted request (it never
    samples EOS; kvsched.worker_stub.engine.check_stop: length first, stop tokens once
    min_tokens are out, the stopping token kept)."""
    sp = msg.sampling
    max_tokens = effective_max_tokens(sp)
    stop = set(sp.stop_token_ids)
    out: list[int] = []
    n = len(msg.prompt_token_ids)
    while True:
        token = SIM.token_at(req_id, n + len(out))
        out.append(token)
        if len(out) >= max_tokens:
            return out, LENGTH
        if len(out) >= sp.min_tokens and token in stop:
            return out, STOP


# ---- what the daemon must answer --------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """INVALID_ARGUMENT with `needle` in the message, accepted (needle None), or either
    (`maybe`: a documented precondition the daemon does not check; see the report)."""

    needle: str | None
    maybe: bool = False
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


def verdict(msg: rpb.GenerateRequest, live_ids: set[str]) -> Verdict:
    """What the daemon answers to `msg`: the checks of request_service.proto step 2, in the
    order RequestTable.submit (kvsched.server.requests.table) and
    kvsched.core.scheduler._validate make them."""
    sp, prompt = msg.sampling, msg.prompt_token_ids
    n = len(prompt)
    max_tokens = effective_max_tokens(sp)
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    if msg.model and msg.model != MODEL:
        return Verdict("unknown model", code=grpc.StatusCode.NOT_FOUND)
    if msg.lora_name:  # the sim worker announces no LoRA adapter
        return Verdict("unknown LoRA adapter", code=grpc.StatusCode.NOT_FOUND)
    if msg.request_id in live_ids:
        return Verdict("already in use")
    if n == 0:
        return Verdict("prompt_token_ids is empty")
    if max_tokens < 1:
        return Verdict("max_tokens")
    if not 0 <= sp.min_tokens <= max_tokens:
        return Verdict("min_tokens")
    if n + max_tokens > MAX_MODEL_LEN:
        return Verdict("max_model_len")
    if min(prompt) < 0:
        return Verdict("token ids must be in [0, 2^31)")
    if not (math.isfinite(sp.temperature) and math.isfinite(top_p)):
        return Verdict("temperature and top_p must be finite numbers")  # NaN, inf (float32)
    if sp.temperature < 0 or not 0 < top_p <= 1 or sp.top_k < 0:
        return Verdict("temperature >= 0, 0 < top_p <= 1, top_k >= 0")
    for r in msg.mm_ranges:
        if r.offset < 0 or r.length < 1 or r.offset + r.length > n or not r.content_hash:
            return Verdict("multimodal range")
    ranges = [(r.offset, r.offset + r.length) for r in msg.mm_ranges]
    if any(a[1] > b[0] for a, b in itertools.pairwise(ranges)):
        return Verdict(None, maybe=True)  # "sorted, not overlapping" is not enforced
    # Then the limits the sim worker announced (server/instances/models.py): its vocabulary.
    if max(prompt) >= VOCAB_SIZE or any(t >= VOCAB_SIZE for t in sp.stop_token_ids):
        return Verdict("outside the vocabulary")
    return Verdict(None)


# ---- well-formed traffic alongside the fuzzing ----------------------------------------------

PREFIX = [11 + i for i in range(64)]  # cached on i0 after the first request: routing sticks there


@dataclass
class Traffic:
    """Lanes that each keep one well-formed request running, and check every one of them: routed
    to the real worker, every expected token, finished by LENGTH. Submissions happen under
    `routing`, which tests hold while a fake worker's instance could take new requests."""

    stub: request_service_pb2_grpc.RequestServiceStub
    routing: asyncio.Lock
    instance: str = "i0"
    lanes: int = 2
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _done: asyncio.Condition = field(default_factory=asyncio.Condition)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._lane(i)) for i in range(self.lanes)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _lane(self, lane: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            spec = Spec(f"bg-{lane}-{n}", [*PREFIX, lane, n % 30000 + 3], 16 + n % 24)
            try:
                out = await self._one(spec)
            except Exception as exc:  # a hang or a broken stream: report it, keep going
                self.failures.append(f"{spec.req_id}: {exc!r}")
                continue
            problem = self._check(spec, out)
            if problem:
                self.failures.append(f"{spec.req_id}: {problem}")
                continue
            async with self._done:
                self.completed += 1
                self._done.notify_all()

    async def wait_beyond(self, completed: int) -> None:
        """Until more than `completed` requests have completed (and were all right)."""
        async with self._done:
            await self._done.wait_for(lambda: self.completed > completed)

    async def _one(self, spec: Spec) -> Outcome:
        queued = asyncio.Event()
        async with self.routing:
            task = asyncio.ensure_future(generate(self.stub, spec.message(), queued=queued))
            waiter = asyncio.ensure_future(queued.wait())
            await asyncio.wait({task, waiter}, timeout=15, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return await within(task, 30, spec.req_id)

    def _check(self, spec: Spec, out: Outcome) -> str:
        if out.code is not None:
            return f"{out.code}: {out.details}"
        if out.instance != self.instance:
            return f"routed to {out.instance!r}, not {self.instance!r}"
        if out.finished is None or out.finished.reason != LENGTH:
            return f"finished {out.finished}"
        if out.tokens != spec.expected:
            return f"tokens {out.tokens} != expected {spec.expected}"
        return ""


# ---- a worker stream driven by hand ---------------------------------------------------------

Status = tuple[grpc.StatusCode, str]


class FakeWorker:
    """One WorkerService.Connect stream whose every message the test writes. Tracks what a
    well-behaved worker would send: steps increasing from 1, applied_seq = the last Tasks seq
    received."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        self._outbox: asyncio.Queue[wpb.ConnectRequest | None] = asyncio.Queue()
        self._inbox: asyncio.Queue[wpb.ConnectResponse | None] = asyncio.Queue()
        self._reader: asyncio.Task[Status] | None = None
        self.step = 0
        self.seq = 0
        self.tasks: list[wpb.Tasks] = []

    def start(self, first: wpb.ConnectRequest) -> None:
        call = self._stub.Connect(self._requests())
        self._reader = asyncio.ensure_future(self._read(call))
        self.send(first)

    async def _requests(self):
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def _read(self, call: Any) -> Status:
        try:
            async for response in call:
                await self._inbox.put(response)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        finally:
            await self._inbox.put(None)
            self._outbox.put_nowait(None)  # ends the request generator
        return grpc.StatusCode.OK, ""

    def send(self, msg: wpb.ConnectRequest) -> None:
        self._outbox.put_nowait(msg)

    def report(self, **columns: Any) -> None:
        """A StepReport for the next step; `step` / `applied_seq` in `columns` override."""
        self.step += 1
        fields = {"step": self.step, "applied_seq": self.seq, **columns}
        self.step = fields["step"]
        self.send(wpb.ConnectRequest(report=wpb.StepReport(**fields)))

    async def expect(self, kind: str, timeout: float = 10.0) -> wpb.ConnectResponse:
        """The next message of `kind` (peers lists are skipped); AssertionError if the stream
        ends first."""
        while True:
            msg = await within(self._inbox.get(), timeout, f"waiting for {kind}")
            if msg is None:
                code, details = await self.ended()
                raise AssertionError(f"stream ended ({code}: {details}) before {kind}")
            got = msg.WhichOneof("kind")
            if got == "tasks":
                self.seq = max(self.seq, msg.tasks.seq)
                self.tasks.append(msg.tasks)
            if got == kind:
                return msg
            if got not in ("peers", "heartbeat", "tasks"):
                raise AssertionError(f"expected {kind}, got {msg}")

    async def tasks_where(self, wanted: Any, timeout: float = 10.0) -> wpb.Tasks:
        """The first Tasks (already received or next) for which `wanted(tasks)` holds."""
        for t in self.tasks:
            if wanted(t):
                return t
        while True:
            t = (await self.expect("tasks", timeout)).tasks
            if wanted(t):
                return t

    async def ended(self, timeout: float = 10.0) -> Status:
        """How the daemon ended the stream (waits for it)."""
        assert self._reader is not None
        return await within(asyncio.shield(self._reader), timeout, "waiting for the stream end")

    async def close(self) -> Status:
        """Half-close (the worker leaves) and return how the stream ended."""
        self._outbox.put_nowait(None)
        return await self.ended()

    def cancel(self) -> None:
        self._outbox.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
