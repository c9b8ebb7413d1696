"""Property-based fuzzing of every RPC against one long-lived daemon with one real sim worker.

Hypothesis sends malformed and out-of-range messages to RequestService (Generate, Abort, Session),
AdminService (every RPC) and protocol-violating sequences to WorkerService. Each must get its
documented status (request_service.proto step 2, worker_service.proto steps 1-9): never INTERNAL,
never a hang. Meanwhile background lanes keep well-formed requests running on the real worker, and
every one of them must come back routed there with exactly the sim's tokens; after each test the
daemon still answers health checks with SERVING and has logged no unexpected error.

Out-of-range Hello sizes, a NaN temperature, prompts larger than the KV pool and overlapping
multimodal ranges were bugs found here and are now rejected; the strategies still keep inside those
limits where the oracle does not model them (unit tests in tests/core cover them). A single request
message that does not decode gets UNKNOWN from grpc before any interceptor runs: a strict xfail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from kvsched.codec import PROTOCOL_VERSION
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.v1 import worker_service_pb2 as wpb
from tests.integration.clients import SIM
from tests.integration.fuzzkit import (
    ABORT,
    LENGTH,
    MAX_MODEL_LEN,
    FakeWorker,
    LoopThread,
    Traffic,
    effective_max_tokens,
    sim_output,
    verdict,
    within,
)
from tests.integration.harness import Proc, start_daemon, start_worker, wait_ready

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
OK = grpc.StatusCode.OK
LIVE_ID = "fz-live"  # a request kept running during the Generate fuzz: its id is taken
SMALL = 24  # accepted requests up to this many output tokens are read to the end and checked

FUZZ = settings(
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # live_request: one for all examples, on purpose
    ],
)


# ---- one daemon, one real worker, background traffic -------------------------------------------


@dataclass
class Env:
    address: str
    daemon: Proc
    loop: LoopThread
    channel: grpc.aio.Channel
    traffic: Traffic
    routing: asyncio.Lock
    used_ids: set[str]
    num_fake: int = 0
    section_mark: tuple[int, int] = (0, 0)

    @property
    def requests(self) -> request_service_pb2_grpc.RequestServiceStub:
        return request_service_pb2_grpc.RequestServiceStub(self.channel)

    @property
    def admin(self) -> admin_service_pb2_grpc.AdminServiceStub:
        return admin_service_pb2_grpc.AdminServiceStub(self.channel)

    def unique(self, req_id: str) -> str:
        """`req_id`, or it with a suffix if it was used before ("" and LIVE_ID stay as they are:
        the daemon assigns one / it is taken on purpose)."""
        if req_id not in ("", LIVE_ID) and (req_id in self.used_ids or req_id.startswith("bg-")):
            req_id = f"{req_id}#{len(self.used_ids)}"
        self.used_ids.add(req_id)
        return req_id

    def fake_id(self) -> str:
        self.num_fake += 1
        return f"fz-w{self.num_fake}"

    def mark(self) -> tuple[int, int]:
        """Where the background traffic and the daemon's log are now, for `check_alive`."""
        return self.traffic.completed, len(self.daemon.lines)

    def quick_check(self) -> None:
        assert self.daemon.popen.poll() is None, self.daemon.output()
        assert not self.traffic.failures, self.traffic.failures[:5]

    def check_alive(self, mark: tuple[int, int]) -> None:
        """Since `mark`: the daemon is up and SERVING, the background requests were all right
        and some completed, and the daemon logged no unexpected error (what becomes INTERNAL)."""
        completed_before, num_lines = mark
        self.quick_check()
        with grpc.insecure_channel(self.address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        self.loop.run(within(self.traffic.wait_beyond(completed_before), 30, "background traffic"))
        self.quick_check()
        unexpected = [line for line in self.daemon.lines[num_lines:] if "unexpected" in line]
        assert not unexpected, "\n".join(unexpected)

    def check_section(self) -> None:
        """check_alive since the previous section of this file ended."""
        mark, self.section_mark = self.section_mark, self.mark()
        self.check_alive(mark)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    daemon, address = start_daemon()
    # 8200 blocks of 16 hold any prompt max_model_len allows (see the head-of-line bug).
    worker = start_worker(address, "i0", "--zero-cost", "--num-blocks", "8200")
    loop = LoopThread()
    try:
        wait_ready(address, ["i0"])

        async def setup() -> Env:
            channel = grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", 256 << 20)]
            )
            routing = asyncio.Lock()
            stub = request_service_pb2_grpc.RequestServiceStub(channel)
            traffic = Traffic(stub, routing)
            traffic.start()
            return Env(address, daemon, loop, channel, traffic, routing, set())

        e = loop.run(setup())
        e.section_mark = e.mark()
        yield e

        async def teardown() -> None:
            await within(e.traffic.stop(), 30, "stopping the traffic")
            await e.channel.close()

        loop.run(teardown())
        assert not e.traffic.failures, e.traffic.failures[:5]
        assert e.traffic.completed > 0
    finally:
        loop.close()
        worker.stop()
        daemon.stop()


# ---- strategies -------------------------------------------------------------------------------

int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=24)  # any code point but surrogates (not encodable as UTF-8)


def rarely(usual: st.SearchStrategy, unusual: st.SearchStrategy, one_in: int = 4):
    """`usual`, or `unusual` about one draw in `one_in` (shrinking goes to `usual`)."""
    return st.integers(0, one_in - 1).flatmap(lambda k: unusual if k == one_in - 1 else usual)


wild_prompts = st.one_of(
    st.just([]),
    st.lists(int32, min_size=1, max_size=40),
    # Long prompts, up to over max_model_len: one repeated token keeps generation cheap.
    st.builds(lambda n, t: [t] * n, st.integers(1, MAX_MODEL_LEN + 100), st.integers(0, 30000)),
)
prompts = rarely(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300), wild_prompts, 3)
floats = st.floats(allow_nan=False, allow_infinity=False)  # NaN/inf: test_non_finite_sampling


@st.composite
def wild_sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    """Any value of every field."""
    sp = common_pb2.SamplingParams(
        min_tokens=draw(int32),
        temperature=draw(floats),
        top_k=draw(int32),
        seed=draw(uint64),
        stop_token_ids=draw(st.lists(int32, max_size=4)),
        ignore_eos=draw(st.booleans()),
    )
    max_tokens = draw(st.one_of(st.none(), int32, st.integers(MAX_MODEL_LEN - 300, 2**31 - 1)))
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    top_p = draw(st.one_of(st.none(), st.floats()))  # NaN, inf, <= 0, > 1: invalid
    if top_p is not None:
        sp.top_p = top_p
    return sp


@st.composite
def sane_sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    """Values a front end would send, short outputs mostly."""
    max_tokens = draw(rarely(st.integers(1, SMALL), st.integers(SMALL + 1, 4096), 5))
    sp = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        temperature=draw(st.floats(0, 2)),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.integers(0, 100)),
        seed=draw(uint64),
        stop_token_ids=draw(st.lists(st.integers(0, 31999), max_size=3)),
        ignore_eos=draw(st.booleans()),
    )
    if draw(st.booleans()):
        sp.ClearField("max_tokens")  # the default, 16
        sp.min_tokens = min(sp.min_tokens, 16)
    return sp


wild_mm_ranges = st.lists(
    st.builds(
        common_pb2.MultimodalRange,
        offset=st.one_of(st.integers(-3, 300), int32),
        length=st.one_of(st.integers(-3, 100), int32),
        content_hash=st.one_of(st.just(""), text),
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def mm_ranges_in(draw: st.DrawFn, n: int) -> list[common_pb2.MultimodalRange]:
    """Sorted, disjoint ranges inside a prompt of n tokens."""
    cuts = sorted(draw(st.sets(st.integers(0, n), min_size=2, max_size=6)))
    pairs = list(zip(cuts[::2], cuts[1::2], strict=False))
    return [
        common_pb2.MultimodalRange(offset=a, length=b - a, content_hash=f"img{a}") for a, b in pairs
    ]


@st.composite
def generate_requests(draw: st.DrawFn) -> rpb.GenerateRequest:
    prompt = draw(prompts)
    n = len(prompt)
    sane_mm = mm_ranges_in(n) if 0 < n <= 1000 else st.just([])
    mm = draw(rarely(st.one_of(st.just([]), sane_mm), wild_mm_ranges, 5))
    return rpb.GenerateRequest(
        request_id=draw(
            rarely(rarely(st.text(min_size=1, max_size=24), st.just(""), 3), st.just(LIVE_ID), 10)
        ),
        prompt_token_ids=prompt,
        sampling=draw(rarely(sane_sampling(), wild_sampling(), 3)),
        priority=draw(int32),
        lora_name=draw(rarely(st.just(""), text, 5)),  # (a name: NOT_FOUND, none announced)
        cache_salt=draw(text),
        mm_ranges=mm,
        model=draw(rarely(st.sampled_from(["", "default"]), text, 10)),
        detachable=draw(st.booleans()),
    )


def is_small(msg: rpb.GenerateRequest) -> bool:
    return effective_max_tokens(msg.sampling) <= SMALL and len(msg.prompt_token_ids) <= 4096


# ---- RequestService.Generate and Abort ---------------------------------------------------------


@pytest.fixture
def live_request(env: Env) -> Iterator[None]:
    """A request that runs through the whole Generate fuzz (one test, all its examples): its
    id is in use."""
    spec = rpb.GenerateRequest(
        request_id=LIVE_ID,
        prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=100_000, ignore_eos=True),
    )

    async def start() -> grpc.aio.UnaryStreamCall:
        call = env.requests.Generate(spec)
        first = await within(call.read(), 10, "the live request")
        assert first.WhichOneof("kind") == "queued"
        return call

    call = env.loop.run(start())
    env.used_ids.add(LIVE_ID)
    yield

    async def stop() -> None:
        call.cancel()

    env.loop.run(stop())


async def check_generate(env: Env, msg: rpb.GenerateRequest, stop_at: int | None) -> str:
    msg.request_id = env.unique(msg.request_id)
    if stop_at is not None and msg.request_id:  # a stop token the sim will produce
        n = len(msg.prompt_token_ids)
        msg.sampling.stop_token_ids.append(SIM.token_at(msg.request_id, n + stop_at))
    want = verdict(msg, {LIVE_ID})
    call = env.requests.Generate(msg)
    try:
        first = await within(call.read(), 20, "Generate's first answer")
    except grpc.aio.AioRpcError as exc:
        assert want.needle is not None or want.maybe, f"rejected a valid request: {exc}"
        assert exc.code() == want.code, exc
        assert want.maybe or want.needle in exc.details(), (want.needle, exc.details())
        return f"rejected: {want.needle}"
    assert want.needle is None, f"accepted; wanted INVALID_ARGUMENT ({want.needle})"
    assert first.WhichOneof("kind") == "queued", first
    rid = first.queued.request_id
    assert rid == (msg.request_id or rid) and rid, first
    assert first.queued.instance == "i0"
    if not is_small(msg):
        call.cancel()  # drops the stream: aborts it unless detachable
        if msg.detachable:
            await env.requests.Abort(rpb.AbortRequest(request_id=rid), timeout=10)
        # Aborting a request that has just finished is OK (the first one wins), twice too.
        await env.requests.Abort(rpb.AbortRequest(request_id=rid), timeout=10)
        return "accepted, stream dropped"
    tokens, finished = [], []
    while (r := await within(call.read(), 20, f"outputs of {rid!r}")) is not grpc.aio.EOF:
        kind = r.WhichOneof("kind")
        assert kind in ("tokens", "finished") and not finished, r
        if kind == "tokens":
            tokens.extend(r.tokens.token_ids)
        else:
            finished.append(r.finished)
    want_tokens, want_reason = sim_output(rid, msg)
    assert tokens == want_tokens
    (fin,) = finished
    assert (fin.request_id, fin.reason) == (rid, want_reason)
    assert (fin.usage.prompt_tokens, fin.usage.output_tokens) == (
        len(msg.prompt_token_ids),
        len(tokens),
    )
    return f"accepted, read to the end: {'LENGTH' if want_reason == LENGTH else 'STOP'}"


@settings(FUZZ, max_examples=200)
@given(msg=generate_requests(), stop_at=st.one_of(st.none(), st.integers(0, 7)))
def test_generate_fuzz(
    env: Env, live_request: None, msg: rpb.GenerateRequest, stop_at: int | None
) -> None:
    event(env.loop.run(check_generate(env, msg, stop_at)))
    env.quick_check()


@settings(FUZZ, max_examples=100)
@given(req_id=st.one_of(text, st.just("")))
def test_abort_unknown_ids_fuzz(env: Env, req_id: str) -> None:
    if req_id in env.used_ids or req_id.startswith("bg-"):
        req_id = f"never-{len(env.used_ids)}-{req_id}"

    async def go() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await env.requests.Abort(rpb.AbortRequest(request_id=req_id), timeout=10)
        assert err.value.code() == NOT_FOUND, err.value
        assert f"no live request with id {req_id!r}" in err.value.details()

    env.loop.run(go())


def test_generate_and_abort_left_the_daemon_serving(env: Env) -> None:
    env.check_section()


# ---- RequestService.Session ------------------------------------------------------------------


session_actions = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), generate_requests(), text),
        st.tuples(st.just("abort_own"), st.integers(0, 7)),
        st.tuples(st.just("abort"), text),
        st.tuples(st.just("empty")),
    ),
    min_size=1,
    max_size=8,
)


@dataclass
class Submitted:
    msg: rpb.GenerateRequest
    tag: str
    accepted_id: str = ""
    error: rpb.SessionResponse.Error | None = None
    aborted: bool = False


async def check_session(env: Env, actions: list[tuple]) -> set[str]:
    outbox: asyncio.Queue[rpb.SessionRequest | None] = asyncio.Queue()
    submits: dict[str, Submitted] = {}  # by tag
    random_aborts: list[str] = []  # ids that must come back NOT_FOUND
    own_aborts: list[str] = []
    empties = 0
    for i, action in enumerate(actions):
        if action[0] == "submit":
            msg, tag = action[1], f"{i}:{action[2]}"
            msg.request_id = env.unique(msg.request_id)
            if msg.request_id == LIVE_ID:
                msg.request_id = env.unique("")  # LIVE_ID is not live now; no duplicates here
            submits[tag] = Submitted(msg, tag)
            outbox.put_nowait(
                rpb.SessionRequest(submit=rpb.SessionRequest.Submit(request=msg, client_tag=tag))
            )
        elif action[0] == "abort_own":
            own = [s for s in submits.values() if s.msg.request_id]
            rid = own[action[1] % len(own)].msg.request_id if own else ""
            own_aborts.append(rid)
            outbox.put_nowait(rpb.SessionRequest(abort=rpb.SessionRequest.Abort(request_id=rid)))
        elif action[0] == "abort":
            rid = action[1] if action[1] not in env.used_ids else f"never-{i}-{action[1]}"
            random_aborts.append(rid)
            outbox.put_nowait(rpb.SessionRequest(abort=rpb.SessionRequest.Abort(request_id=rid)))
        else:
            empties += 1
            outbox.put_nowait(rpb.SessionRequest())
    resolved = asyncio.Event()

    def check_resolved() -> None:
        if all(s.accepted_id or s.error for s in submits.values()):
            resolved.set()

    check_resolved()

    async def requests():
        while (m := await outbox.get()) is not None:
            yield m

    call = env.requests.Session(requests())
    tokens: dict[str, list[int]] = {}
    finished: dict[str, rpb.Finished] = {}
    errors: list[rpb.SessionResponse.Error] = []
    closer = asyncio.ensure_future(_close_when(resolved, outbox))
    try:
        while (m := await within(call.read(), 20, "Session output")) is not grpc.aio.EOF:
            for rid, tag in zip(m.accepted.request_ids, m.accepted.client_tags, strict=True):
                s = submits[tag]
                assert not s.accepted_id and not s.error, tag
                assert rid and rid == (s.msg.request_id or rid)
                s.accepted_id, tokens[rid] = rid, []
                if not is_small(s.msg):  # do not wait for it: abort it now
                    s.aborted = True
                    own_aborts.append(rid)
                    outbox.put_nowait(
                        rpb.SessionRequest(abort=rpb.SessionRequest.Abort(request_id=rid))
                    )
            assert list(m.accepted.instances) == ["i0"] * len(m.accepted.request_ids)
            pos = 0
            for rid, n in zip(m.tokens.request_ids, m.tokens.num_tokens, strict=True):
                assert rid in tokens and rid not in finished, rid
                tokens[rid].extend(m.tokens.token_ids[pos : pos + n])
                pos += n
            assert pos == len(m.tokens.token_ids)
            for f in m.finished:
                assert f.request_id in tokens and f.request_id not in finished, f
                finished[f.request_id] = f
            for e in m.errors:
                if e.client_tag in submits:
                    assert not submits[e.client_tag].accepted_id
                    submits[e.client_tag].error = e
                else:
                    errors.append(e)
            check_resolved()
    finally:
        closer.cancel()
    # Every submit: accepted (exactly one finished) or rejected as the oracle says.
    for s in submits.values():
        want = verdict(s.msg, set())
        if s.error is not None:
            assert want.needle is not None or want.maybe, f"rejected a valid submit: {s.error}"
            assert s.error.code == want.code.value[0], s.error
            assert want.maybe or want.needle in s.error.message, (want.needle, s.error.message)
            continue
        assert want.needle is None, f"accepted; wanted INVALID_ARGUMENT ({want.needle})"
        rid = s.accepted_id
        fin = finished[rid]
        assert fin.usage.output_tokens == len(tokens[rid])
        want_tokens, want_reason = sim_output(rid, s.msg)
        if fin.reason == ABORT:
            assert s.aborted or rid in own_aborts, fin
            assert tokens[rid] == want_tokens[: len(tokens[rid])]
        else:
            assert (tokens[rid], fin.reason) == (want_tokens, want_reason)
    assert set(finished) == {s.accepted_id for s in submits.values() if s.accepted_id}
    # Every other error: an abort of an id this session does not have open, or an empty message.
    not_found = [e for e in errors if e.code == NOT_FOUND.value[0]]
    invalid = [e for e in errors if e.code == INVALID_ARGUMENT.value[0]]
    assert len(not_found) + len(invalid) == len(errors), errors
    assert len(invalid) == empties and all("must set" in e.message for e in invalid)
    missing = [rid for rid in random_aborts if rid not in [e.request_id for e in not_found]]
    assert not missing, (missing, not_found)
    for e in not_found:
        assert e.request_id in random_aborts or e.request_id in own_aborts, e
        assert "no open request" in e.message
    labels = {f"{a[0]}" for a in actions}
    for s in submits.values():
        if s.error is not None:
            labels.add("submit rejected")
        else:
            labels.add(
                f"submit finished {common_pb2.FinishReason.Name(finished[s.accepted_id].reason)}"
            )
    return labels


async def _close_when(resolved: asyncio.Event, outbox: asyncio.Queue) -> None:
    """Half-close once every submit was answered (aborts of large ones are queued by then)."""
    await resolved.wait()
    outbox.put_nowait(None)


@settings(FUZZ, max_examples=120)
@given(actions=session_actions)
def test_session_fuzz(env: Env, actions: list[tuple]) -> None:
    for label in sorted(env.loop.run(check_session(env, actions), timeout=60)):
        event(label)
    env.quick_check()


def test_sessions_left_the_daemon_serving(env: Env) -> None:
    env.check_section()


# ---- WorkerService.Connect ------------------------------------------------------------------


def hello(instance: str, **fields) -> wpb.ConnectRequest:
    h = {
        "instance_id": instance,
        "rank": 0,
        "world_size": 1,
        "num_gpu_blocks": 64,
        "block_size": 16,
        "num_slots": 4,
        "protocol_version": PROTOCOL_VERSION,
        **fields,
    }
    return wpb.ConnectRequest(hello=wpb.Hello(**h))


# A refused first message: (how to build it from a fresh instance id and a random number,
# the text the FAILED_PRECONDITION message must contain).
REFUSED_FIRST = {
    "wrong protocol version": (
        lambda i, x: hello(i, protocol_version=x if x != PROTOCOL_VERSION else x + 1),
        "protocol version",
    ),
    "report before hello": (
        lambda i, x: wpb.ConnectRequest(report=wpb.StepReport(step=x)),
        "first message must be Hello",
    ),
    "heartbeat before hello": (
        lambda i, x: wpb.ConnectRequest(heartbeat=wpb.Heartbeat(time_ns=x)),
        "first message must be Hello",
    ),
    "empty message": (lambda i, x: wpb.ConnectRequest(), "first message must be Hello"),
    "empty instance id": (lambda i, x: hello(""), "instance_id must not be empty"),
    "no blocks": (lambda i, x: hello(i, num_gpu_blocks=0), "num_gpu_blocks"),
    "no block size": (lambda i, x: hello(i, block_size=0), "block_size"),
    "no slots": (lambda i, x: hello(i, num_slots=0), "num_slots"),
    "huge pool": (lambda i, x: hello(i, num_gpu_blocks=2**31 - 1), "num_gpu_blocks"),
    "huge block": (lambda i, x: hello(i, block_size=5000), "block_size"),
    "rank outside world size": (
        lambda i, x: hello(i, world_size=x % 64 + 1, rank=x % 64 + 1 + x % 7),
        "outside world size",
    ),
    "rank 0 of i0 again": (lambda i, x: hello("i0"), "already connected"),
    "world size mismatch with i0": (lambda i, x: hello("i0", world_size=2 + x % 62), "world size"),
    "rank 1 of single-rank i0": (lambda i, x: hello("i0", rank=1), "outside world size"),
}

# A protocol violation after a good start: (kind, needle). Columns that disagree and unknown
# enum values are caught while converting (codec.report_from_proto); the rest by the core.
VIOLATIONS = {
    "report names a handle never issued": "never issued",
    "ack of a handle never issued": "never issued",
    "paused handle never issued": "never issued",
    "failed handle never issued": "never issued",
    "applied tasks never sent": "applied tasks",
    "applied seq goes back": "applied tasks",
    "step not increasing": "steps must increase",
    "columns differ in length": "malformed StepReport",
    "token count mismatch": "num_new_tokens add up",
    "unknown finish reason": "unknown finish reasons",
    "second hello": "second Hello",
    "message without a kind": "must set hello, report or heartbeat",
}


def send_violation(fake: FakeWorker, kind: str, x: int, next_handle: int) -> None:
    """Send a message that breaks the protocol in way `kind`; x is a random number and
    next_handle the first handle the daemon has not issued to this instance."""
    never = next_handle + x % 1000
    if kind == "report names a handle never issued":
        fake.report(handles=[never], num_computed=[1], num_new_tokens=[0], finish_reasons=[0])
    elif kind == "ack of a handle never issued":
        fake.report(acked=[never])
    elif kind == "paused handle never issued":
        fake.report(paused=[never])
    elif kind == "failed handle never issued":
        fake.report(failed=[never])
    elif kind == "applied tasks never sent":
        fake.report(applied_seq=fake.seq + 1_000_000 + x % 2**40)
    elif kind == "applied seq goes back":
        fake.report()  # applied_seq = the last seq received, at least 1 here
        fake.report(applied_seq=fake.seq - 1 - x % fake.seq)
    elif kind == "step not increasing":
        fake.report()
        fake.report(step=fake.step - x % (fake.step + 1))
    elif kind == "columns differ in length":
        fake.report(handles=[0, 1][: 1 + x % 2], num_computed=[], num_new_tokens=[0])
    elif kind == "token count mismatch":
        fake.report(handles=[0], num_computed=[1], num_new_tokens=[1 + x % 5], finish_reasons=[0])
    elif kind == "unknown finish reason":
        reason = 5 + x % 1000 if x % 2 else -1 - x % 1000
        fake.report(handles=[0], num_computed=[1], num_new_tokens=[0], finish_reasons=[reason])
    elif kind == "second hello":
        fake.send(hello("fz-second"))
    elif kind == "message without a kind":
        fake.send(wpb.ConnectRequest())
    else:
        raise AssertionError(kind)


async def fake_hello(env: Env, instance: str, **fields) -> FakeWorker:
    fake = FakeWorker(env.channel)
    fake.start(hello(instance, **fields))
    welcome = (await fake.expect("welcome")).welcome
    assert (welcome.protocol_version, welcome.instance_id) == (PROTOCOL_VERSION, instance)
    assert welcome.block_size == fields.get("block_size", 16)
    assert welcome.max_model_len == MAX_MODEL_LEN
    return fake


async def instance_state(env: Env, instance: str) -> apb.InstanceStatus:
    (st,) = (
        await env.admin.GetStatus(apb.GetStatusRequest(instance_id=instance), timeout=5)
    ).instances
    return st


async def ends_with(fake: FakeWorker, code: grpc.StatusCode, needle: str) -> None:
    got, details = await fake.ended()
    assert got == code and needle in details, (got, details, needle)


async def worker_refused_first(env: Env, case: str, x: int) -> None:
    build, needle = REFUSED_FIRST[case]
    fake = FakeWorker(env.channel)
    fake.start(build(env.fake_id(), x))
    await ends_with(fake, FAILED_PRECONDITION, needle)
    assert (await instance_state(env, "i0")).ready  # the real instance is untouched


async def worker_bad_reports(env: Env, fields: dict, script: list[tuple[str, int]]) -> None:
    """A good hello, then heartbeats, good reports and protocol violations in any order: the
    first violation ends the stream with FAILED_PRECONDITION and takes the instance out."""
    instance = env.fake_id()
    fake = await fake_hello(env, instance, **fields)
    assert (await instance_state(env, instance)).ready
    expected: tuple[grpc.StatusCode, str] = (OK, "")
    for kind, x in script:
        if kind == "heartbeat":
            fake.send(wpb.ConnectRequest(heartbeat=wpb.Heartbeat(time_ns=x)))
        elif kind == "good report":
            fake.report(step=fake.step + 1 + x % 3)  # steps may skip; nothing ran
        elif kind == "applied seq goes back":
            continue  # needs a Tasks message: see worker_with_a_request
        else:
            send_violation(fake, kind, x, next_handle=0)
            expected = (FAILED_PRECONDITION, VIOLATIONS[kind])
            break
    if expected[0] == OK:
        assert (await fake.close()) == (OK, "")
    else:
        await ends_with(fake, *expected)
        assert not (await instance_state(env, instance)).ready


async def worker_tp(env: Env, variant: str, x: int) -> None:
    """Two ranks of one instance: the second agrees (the instance becomes ready, and a report
    from rank 1 takes it out) or disagrees with the first (only the second is refused)."""
    instance = env.fake_id()
    rank0 = await fake_hello(env, instance, world_size=2)
    rank1 = FakeWorker(env.channel)
    second = {
        "agrees": {},
        "block size differs": {"block_size": 32},
        "world size differs": {"world_size": 3 + x % 60},
        "rank 0 twice": {"rank": 0},
        "rank outside world size": {"rank": 2 + x % 100},
    }[variant]
    rank1.start(hello(instance, **{"world_size": 2, "rank": 1, **second}))
    if variant != "agrees":
        needle = {
            "block size differs": "block_size = 32",  # names the Hello field
            "world size differs": "world size",
            "rank 0 twice": "already connected",
            "rank outside world size": "outside world size",
        }[variant]
        await ends_with(rank1, FAILED_PRECONDITION, needle)
        st = await instance_state(env, instance)
        assert not st.ready and st.num_ranks_connected == 1
        assert (await rank0.close()) == (OK, "")
        return
    await rank1.expect("welcome")
    assert (await instance_state(env, instance)).ready
    rank1.report()
    await ends_with(rank1, FAILED_PRECONDITION, "only rank 0 reports")
    # Rank 0 did nothing wrong but its instance is gone; it is told the same.
    await ends_with(rank0, FAILED_PRECONDITION, "only rank 0 reports")
    assert not (await instance_state(env, instance)).ready


@dataclass
class Probe:
    """A client request placed on a fake worker's instance."""

    msg: rpb.GenerateRequest
    call: grpc.aio.UnaryStreamCall
    handle: int
    num_blocks: int


async def place_probe(env: Env, fake: FakeWorker, instance: str, n: int, m: int) -> Probe:
    """Route one request to the fake instance: i0 drains for the moment it is submitted."""
    msg = rpb.GenerateRequest(
        request_id=env.unique(f"fz-probe-{instance}"),
        prompt_token_ids=[5 + i % 300 for i in range(n)],
        sampling=common_pb2.SamplingParams(max_tokens=m, ignore_eos=True),
    )
    await env.admin.Drain(apb.DrainRequest(instance_id="i0"), timeout=5)
    try:
        call = env.requests.Generate(msg)
        first = await within(call.read(), 10, "the probe's queued")
    finally:
        await env.admin.Resume(apb.ResumeRequest(instance_id="i0"), timeout=5)
    assert first.queued.instance == instance, first
    tasks = await fake.tasks_where(lambda t: len(t.placements) > 0)
    (p,) = tasks.placements
    assert p.request_id == msg.request_id and p.num_prefill_tokens == n
    assert list(tasks.chunks.handles) == [p.handle]
    assert list(tasks.chunks.token_ids) == list(msg.prompt_token_ids)
    return Probe(msg, call, p.handle, len(p.block_ids))


async def outcome(probe: Probe) -> tuple[list[int], rpb.Finished]:
    tokens, fin = [], None
    while (r := await within(probe.call.read(), 20, "the probe")) is not grpc.aio.EOF:
        if r.WhichOneof("kind") == "tokens":
            tokens.extend(r.tokens.token_ids)
        else:
            assert fin is None
            fin = r.finished
    assert fin is not None
    return tokens, fin


def run_to_length(fake: FakeWorker, probe: Probe, handle: int, extra: int, x: int) -> list[int]:
    """Report the probe's outputs in one step: max_tokens of them, plus `extra` beyond it that
    the daemon must drop. Returns the tokens the client must see."""
    m = probe.msg.sampling.max_tokens
    tokens = [(x + 7 * i) % 32000 for i in range(m + extra)]
    fake.report(
        handles=[handle],
        num_computed=[len(probe.msg.prompt_token_ids)],
        num_new_tokens=[len(tokens)],
        token_ids=tokens,
        finish_reasons=[LENGTH if not extra else 0],
    )
    return tokens[:m]


async def worker_with_a_request(env: Env, flow: str, ending: str, n: int, m: int, x: int) -> None:
    """A fake worker gets a real request; acknowledgements of handles that are not awaiting one
    (running, finished, aborted, already acknowledged) are ignored (worker_service.proto step 7,
    Scheduler.apply_report); the request ends as the flow says. Then a violation or a clean
    close."""
    instance = env.fake_id()
    fake = await fake_hello(env, instance)
    probe = await place_probe(env, fake, instance, n, m)
    h = probe.handle
    next_handle = h + 1
    want_tokens: list[int] | None = None
    if flow == "finish":  # an ack of a running handle, then the outputs (some too many)
        fake.report(acked=[h])
        want_tokens = run_to_length(fake, probe, h, extra=x % 3, x=x)
        tokens, fin = await outcome(probe)
        assert (tokens, fin.reason) == (want_tokens, LENGTH)
        fake.report(acked=[h, h])  # a finished handle, twice
        late = {"num_computed": [n], "num_new_tokens": [1], "token_ids": [9], "finish_reasons": [0]}
        fake.report(handles=[h], **late)  # about a finished occupant: dropped
    elif flow == "abort":  # the client aborts; the worker acknowledges, then again
        await env.requests.Abort(rpb.AbortRequest(request_id=probe.msg.request_id), timeout=5)
        tokens, fin = await outcome(probe)
        assert (tokens, fin.reason) == ([], ABORT)  # ended at once, before the ack
        await fake.tasks_where(lambda t: h in t.aborts)
        fake.report(acked=[h])
        fake.report(acked=[h])
    elif flow == "preempt":  # pause preempts it; ack, duplicate ack; resume places it anew
        await env.admin.Pause(apb.PauseRequest(instance_id=instance), timeout=5)
        await fake.tasks_where(lambda t: h in t.preempts)
        fake.report(acked=[h])
        fake.report(acked=[h])
        await env.admin.Resume(apb.ResumeRequest(instance_id=instance), timeout=5)
        tasks = await fake.tasks_where(lambda t: any(p.handle > h for p in t.placements))
        (p,) = tasks.placements
        assert p.request_id == probe.msg.request_id and p.num_output_tokens == 0
        next_handle = p.handle + 1
        want_tokens = run_to_length(fake, probe, p.handle, extra=0, x=x)
        tokens, fin = await outcome(probe)
        assert (tokens, fin.reason) == (want_tokens, LENGTH)
        fake.report(acked=[h, p.handle])  # the old handle and the finished one
    elif flow in ("KV beyond the block table", "disconnect"):
        # The instance is lost with the request on it: the request moves to i0 and runs there.
        if flow == "disconnect":
            assert (await fake.close()) == (OK, "")
        else:
            beyond = probe.num_blocks * 16 + 1 + x % 99
            fake.report(handles=[h], num_computed=[beyond], num_new_tokens=[0], finish_reasons=[0])
            await ends_with(fake, FAILED_PRECONDITION, "KV positions")
        tokens, fin = await outcome(probe)
        assert (tokens, fin.reason) == sim_output(probe.msg.request_id, probe.msg)
        assert not (await instance_state(env, instance)).ready
        return
    else:
        raise AssertionError(flow)
    assert (await instance_state(env, instance)).ready  # nothing above was a violation
    if ending == "close":
        assert (await fake.close()) == (OK, "")
    else:
        send_violation(fake, ending, x, next_handle)
        await ends_with(fake, FAILED_PRECONDITION, VIOLATIONS[ending])
    assert not (await instance_state(env, instance)).ready


refused_first = st.tuples(st.just("refused first"), st.sampled_from(sorted(REFUSED_FIRST)), uint32)
hello_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": text,
        "worker_address": text,  # sent to every worker in Peers
        "executor": text,
        "num_gpu_blocks": st.integers(1, 4096),  # out-of-range sizes: the cases above
        "block_size": st.integers(1, 4096),
        "num_slots": st.integers(1, 2**32 - 1),
        "world_size": st.just(0),  # taken as 1
    },
)
bad_reports = st.tuples(
    st.just("bad reports"),
    hello_fields,
    st.lists(
        st.tuples(st.sampled_from(["heartbeat", "good report", *sorted(VIOLATIONS)]), uint64),
        max_size=6,
    ),
)
TP_VARIANTS = [
    "agrees",
    "block size differs",
    "world size differs",
    "rank 0 twice",
    "rank outside world size",
]
two_ranks = st.tuples(st.just("tp"), st.sampled_from(TP_VARIANTS), uint32)
FLOWS_LOSING = ("KV beyond the block table", "disconnect")  # the instance goes, with the request
with_a_request = st.tuples(
    st.just("request"),
    st.sampled_from(["finish", "abort", "preempt", *FLOWS_LOSING]),
    st.sampled_from(["close", *sorted(VIOLATIONS)]),
    st.integers(1, 200),  # prompt tokens
    st.integers(1, 8),  # max_tokens
    uint32,
)
worker_scenarios = st.integers(0, 9).flatmap(
    lambda k: (
        [refused_first, refused_first, bad_reports, bad_reports, two_ranks][k]
        if k < 5
        else with_a_request
    )
)


async def check_worker_scenario(env: Env, scenario: tuple) -> None:
    # While a fake instance could take new requests, the background lanes submit none.
    async with env.routing:
        kind, *args = scenario
        if kind == "refused first":
            await worker_refused_first(env, *args)
        elif kind == "bad reports":
            await worker_bad_reports(env, *args)
        elif kind == "tp":
            await worker_tp(env, *args)
        else:
            await worker_with_a_request(env, *args)
        ready = [
            i.instance_id
            for i in (await env.admin.GetStatus(apb.GetStatusRequest())).instances
            if i.ready
        ]
        assert ready == ["i0"], ready


@settings(FUZZ, max_examples=200)
@given(scenario=worker_scenarios)
def test_worker_protocol_fuzz(env: Env, scenario: tuple) -> None:
    env.loop.run(check_worker_scenario(env, scenario), timeout=60)
    kind, first, *rest = scenario
    if kind == "bad reports":
        violations = [k for k, _ in rest[0] if k in VIOLATIONS and k != "applied seq goes back"]
        event(f"bad reports: {violations[0] if violations else 'none, clean close'}")
    elif kind == "request":
        event(f"request: {first}, then {rest[0] if first not in FLOWS_LOSING else 'lost'}")
    else:
        event(f"{kind}: {first}")
    env.quick_check()


def test_worker_fuzz_left_the_daemon_serving(env: Env) -> None:
    env.check_section()


# ---- AdminService ---------------------------------------------------------------------------

ADMIN_RPCS = {
    "GetStatus": apb.GetStatusRequest,
    "Drain": apb.DrainRequest,
    "Pause": apb.PauseRequest,
    "Resume": apb.ResumeRequest,
    "ResetPrefixCache": apb.ResetPrefixCacheRequest,
}


async def check_admin(env: Env, rpc: str, instance_id: str) -> str:
    """Unknown instance ids are NOT_FOUND; "" means every instance. A Drain or Pause that took
    effect is undone at once (under `routing`, so no new request meets a paused i0)."""
    known = {i.instance_id for i in (await env.admin.GetStatus(apb.GetStatusRequest())).instances}
    method = getattr(env.admin, rpc)
    async with env.routing:  # Pause / Drain of i0: no new request while it does not accept
        try:
            resp = await method(ADMIN_RPCS[rpc](instance_id=instance_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert instance_id not in known and instance_id, exc
            assert exc.code() == NOT_FOUND and f"no instance {instance_id!r}" in exc.details(), exc
            return f"{rpc}: unknown instance"
        finally:
            if rpc in ("Drain", "Pause") and (instance_id in known or not instance_id):
                await env.admin.Resume(apb.ResumeRequest(instance_id=instance_id), timeout=10)
    assert instance_id in known or not instance_id, f"{rpc}({instance_id!r}) answered {resp}"
    ids = [i.instance_id for i in resp.instances] if rpc == "GetStatus" else resp.instance_ids
    if instance_id:
        assert list(ids) == [instance_id], resp
        return f"{rpc}: one instance"
    assert set(ids) == known, resp
    return f"{rpc}: every instance"


@settings(FUZZ, max_examples=150)
@given(
    rpc=st.sampled_from(sorted(ADMIN_RPCS)),
    # fz-w1: a fake worker's instance, taken out by now
    instance_id=rarely(st.sampled_from(["", "i0", "fz-w1"]), text, 2),
)
def test_admin_fuzz(env: Env, rpc: str, instance_id: str) -> None:
    event(env.loop.run(check_admin(env, rpc, instance_id)))
    env.quick_check()


def test_admin_fuzz_left_the_daemon_serving(env: Env) -> None:
    env.check_section()


# ---- limits and bytes that are not the message at all -------------------------------------


def test_a_message_over_the_size_limit_is_resource_exhausted(env: Env) -> None:
    mark = env.mark()
    msg = rpb.GenerateRequest(request_id="x" * (65 << 20), prompt_token_ids=[1])

    async def go() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in env.requests.Generate(msg, timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value

    env.loop.run(go())
    env.check_alive(mark)


METHODS = {
    "/kvsched.v1.RequestService/Generate": "unary_stream",
    "/kvsched.v1.RequestService/Abort": "unary_unary",
    "/kvsched.v1.RequestService/Session": "stream_stream",
    "/kvsched.v1.WorkerService/Connect": "stream_stream",
    "/kvsched.v1.AdminService/GetStatus": "unary_unary",
}
CORRUPT = {
    "truncated varint": b"\xff\xff\xff",
    "length past the end": b"\x0a\x05ab",
    "invalid UTF-8 in a string": b"\x0a\x02\xc3\x28",
}
MESSAGES = {
    "/kvsched.v1.RequestService/Generate": rpb.GenerateRequest,
    "/kvsched.v1.RequestService/Abort": rpb.AbortRequest,
    "/kvsched.v1.RequestService/Session": rpb.SessionRequest,
    "/kvsched.v1.WorkerService/Connect": wpb.ConnectRequest,
    "/kvsched.v1.AdminService/GetStatus": apb.GetStatusRequest,
}


def call_raw(env: Env, method: str, payload: bytes) -> grpc.StatusCode:
    async def go() -> grpc.StatusCode:
        identity = {"request_serializer": None, "response_deserializer": None}
        shape = METHODS[method]
        rpc = getattr(env.channel, shape)(method, **identity)
        try:
            if shape == "unary_unary":
                await rpc(payload, timeout=10)
            elif shape == "unary_stream":
                async for _ in rpc(payload, timeout=10):
                    pass
            else:
                call = rpc(iter([payload]), timeout=10)
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return OK

    return env.loop.run(go())


STREAMING_REQUESTS = {"/kvsched.v1.RequestService/Session", "/kvsched.v1.WorkerService/Connect"}
UNARY_DECODE_BUG = pytest.mark.xfail(
    strict=True,
    reason="known gap: a single request message that does not decode is rejected by grpc itself, "
    "before any interceptor runs, with UNKNOWN",
)


@pytest.mark.parametrize(
    "method",
    [
        m if m in STREAMING_REQUESTS else pytest.param(m, marks=UNARY_DECODE_BUG)
        for m in sorted(METHODS)
    ],
)
def test_undecodable_requests_are_invalid_argument(env: Env, method: str) -> None:
    for payload in CORRUPT.values():  # the premise: none of them parses
        with pytest.raises(DecodeError):
            MESSAGES[method].FromString(payload)
    completed, _ = env.mark()
    codes = {name: call_raw(env, method, payload) for name, payload in CORRUPT.items()}
    env.check_alive((completed, len(env.daemon.lines)))  # whatever the code, it lives on
    want = {INVALID_ARGUMENT, FAILED_PRECONDITION} if "Worker" in method else {INVALID_ARGUMENT}
    assert set(codes.values()) <= want, codes
