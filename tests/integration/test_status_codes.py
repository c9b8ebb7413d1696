"""The status-code table of RequestService (protos/kvsched/v1/request_service.proto, "Status
codes"), row by row: each code an RPC may answer is provoked for real against a daemon with an
auth file and a sim worker, and the answer is that code. A row the table lists and this test
cannot provoke on one daemon is named in the table itself ("not provoked here")."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.harness import start_daemon, start_worker
from tests.integration.test_auth import TOKENS, as_role, write_auth_file
from tests.integration.test_overload import config

Md = tuple[tuple[str, str], ...]
CLIENT = as_role("client")
C = grpc.StatusCode


class Daemon:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.rs = request_service_pb2_grpc.RequestServiceStub(self.channel)
        self.admin = admin_service_pb2_grpc.AdminServiceStub(self.channel)

    def generate(self, req: rpb.GenerateRequest, md: Md = CLIENT) -> list[rpb.GenerateResponse]:
        return list(self.rs.Generate(req, metadata=md, timeout=30))

    def resume(self, req: rpb.RequestServiceResumeRequest, md: Md = CLIENT) -> list[object]:
        return list(self.rs.Resume(req, metadata=md, timeout=30))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    auth = write_auth_file(tmp_path_factory.mktemp("auth"))
    cfg = config("[engine.scheduler]\nmax_waiting = 1\n")
    proc, address = start_daemon("--auth-file", auth, "--config", cfg)
    worker = start_worker(address, "i0", "--token", TOKENS["worker"], "--vocab-size", "512")
    d = Daemon(address)
    try:
        _wait_ready(d)
        yield d
    finally:
        d.channel.close()
        worker.stop()
        proc.stop()


def _wait_ready(d: Daemon) -> None:
    import time

    deadline = time.monotonic() + 60
    while True:
        st = d.admin.GetStatus(apb.GetStatusRequest(), metadata=as_role("admin"), timeout=5)
        if any(i.instance_id == "i0" and i.ready for i in st.instances):
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


def req(
    rid: str = "", prompt: tuple[int, ...] = (5, 6, 7), **sampling: object
) -> rpb.GenerateRequest:
    model = str(sampling.pop("model", ""))
    params = common_pb2.SamplingParams(**{"max_tokens": 2, **sampling})  # type: ignore[arg-type]
    return rpb.GenerateRequest(
        request_id=rid, prompt_token_ids=list(prompt), sampling=params, model=model
    )


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return C.OK


def test_generate_codes(daemon: Daemon) -> None:
    d = daemon
    assert code_of(lambda: d.generate(req("ok"))) == C.OK
    # INVALID_ARGUMENT: empty prompt, values out of range, over max_model_len, outside the vocab
    assert code_of(lambda: d.generate(req(prompt=()))) == C.INVALID_ARGUMENT
    assert code_of(lambda: d.generate(req(max_tokens=0))) == C.INVALID_ARGUMENT
    assert code_of(lambda: d.generate(req(top_p=2.0))) == C.INVALID_ARGUMENT
    assert code_of(lambda: d.generate(req(max_tokens=10**9))) == C.INVALID_ARGUMENT
    assert code_of(lambda: d.generate(req(prompt=(5, 600)))) == C.INVALID_ARGUMENT
    # a structured-output constraint the sim worker cannot apply (its Hello does not announce it)
    so = common_pb2.StructuredOutput(regex="[0-9]+")
    assert code_of(lambda: d.generate(req(structured_output=so))) == C.INVALID_ARGUMENT
    long_group = req()
    long_group.sample_group = "g" * 129  # over 128 bytes
    assert code_of(lambda: d.generate(long_group)) == C.INVALID_ARGUMENT
    # NOT_FOUND: a model no instance serves
    assert code_of(lambda: d.generate(req(model="nope"))) == C.NOT_FOUND
    # UNAUTHENTICATED / PERMISSION_DENIED
    assert code_of(lambda: d.generate(req(), md=())) == C.UNAUTHENTICATED
    assert code_of(lambda: d.generate(req(), md=as_role("worker"))) == C.PERMISSION_DENIED
    # RESOURCE_EXHAUSTED: the paused instance's queue holds max_waiting (1) requests; and a
    # request_id in use is INVALID_ARGUMENT
    admin = as_role("admin")
    d.admin.Pause(apb.PauseRequest(instance_id="i0"), metadata=admin, timeout=10)
    held = d.rs.Generate(req("held"), metadata=CLIENT, timeout=30)
    try:
        assert next(held).WhichOneof("kind") == "queued"
        assert code_of(lambda: d.generate(req("second"))) == C.RESOURCE_EXHAUSTED
        assert code_of(lambda: d.generate(req("held", prompt=(9,)))) == C.INVALID_ARGUMENT
    finally:
        d.admin.Resume(apb.ResumeRequest(instance_id="i0"), metadata=admin, timeout=10)
        assert list(held)[-1].finished.reason == common_pb2.FINISH_REASON_LENGTH


def test_abort_codes(daemon: Daemon) -> None:
    d = daemon
    d.generate(req("done"))

    def abort(rid: str, md: Md = CLIENT, reason: int = 0) -> object:
        return d.rs.Abort(rpb.AbortRequest(request_id=rid, reason=reason), metadata=md, timeout=10)

    assert code_of(lambda: abort("done")) == C.OK  # finished: no effect
    assert code_of(lambda: abort("never")) == C.NOT_FOUND
    assert code_of(lambda: abort("done", reason=common_pb2.FINISH_REASON_LENGTH)) == (
        C.INVALID_ARGUMENT
    )
    assert code_of(lambda: abort("done", md=())) == C.UNAUTHENTICATED
    assert code_of(lambda: abort("done", md=as_role("worker"))) == C.PERMISSION_DENIED


def test_abort_with_reason_stop_finishes_the_request_stopped(daemon: Daemon) -> None:
    d = daemon
    call = d.rs.Generate(
        req("to-stop", max_tokens=100_000, ignore_eos=True), metadata=CLIENT, timeout=60
    )
    assert next(call).WhichOneof("kind") == "queued"
    d.rs.Abort(
        rpb.AbortRequest(request_id="to-stop", reason=common_pb2.FINISH_REASON_STOP),
        metadata=CLIENT,
        timeout=10,
    )
    last = list(call)[-1]
    assert last.finished.reason == common_pb2.FINISH_REASON_STOP


def test_resume_codes(daemon: Daemon) -> None:
    d = daemon
    d.generate(req("r-done", max_tokens=3))

    def resume(rid: str, md: Md = CLIENT, n: int = 0) -> object:
        return d.resume(
            rpb.RequestServiceResumeRequest(request_id=rid, num_tokens_received=n), md=md
        )

    assert code_of(lambda: resume("nobody")) == C.NOT_FOUND
    assert code_of(lambda: resume("r-done", md=())) == C.UNAUTHENTICATED
    assert code_of(lambda: resume("r-done", md=as_role("worker"))) == C.PERMISSION_DENIED
    # A live request resumed by another client: PERMISSION_DENIED; with tokens that differ
    # from those it produced: INVALID_ARGUMENT.
    live = d.rs.Generate(
        req("r-live", max_tokens=100_000, ignore_eos=True), metadata=CLIENT, timeout=60
    )
    try:
        first = next(r for r in live if r.WhichOneof("kind") == "tokens").tokens.token_ids[0]
        assert code_of(lambda: resume("r-live", md=as_role("client2"))) == C.PERMISSION_DENIED
        wrong = rpb.RequestServiceResumeRequest(request_id="r-live", token_ids=[(first + 1) % 512])
        assert code_of(lambda: d.resume(wrong)) == C.INVALID_ARGUMENT
    finally:
        d.rs.Abort(rpb.AbortRequest(request_id="r-live"), metadata=CLIENT, timeout=10)
        list(live)


def test_list_models_and_session_codes(daemon: Daemon) -> None:
    d = daemon
    lm = rpb.ListModelsRequest()
    assert code_of(lambda: d.rs.ListModels(lm, metadata=CLIENT, timeout=10)) == C.OK
    assert code_of(lambda: d.rs.ListModels(lm, timeout=10)) == C.UNAUTHENTICATED
    worker = as_role("worker")
    assert code_of(lambda: d.rs.ListModels(lm, metadata=worker, timeout=10)) == C.PERMISSION_DENIED
    # Session: a rejected submit and an abort of an unknown id are in-band errors, with the
    # codes Generate and Abort answer; the session goes on.
    msgs = [
        rpb.SessionRequest(
            submit=rpb.SessionRequest.Submit(request=req(prompt=()), client_tag="e")
        ),
        rpb.SessionRequest(abort=rpb.SessionRequest.Abort(request_id="nobody")),
    ]
    errors: list[int] = []
    for resp in d.rs.Session(iter(msgs), metadata=CLIENT, timeout=30):
        errors += [e.code for e in resp.errors]
    assert sorted(errors) == [C.INVALID_ARGUMENT.value[0], C.NOT_FOUND.value[0]]
    session = d.rs.Session(iter(msgs), timeout=30)
    assert code_of(lambda: list(session)) == C.UNAUTHENTICATED


def test_generate_unavailable_while_draining(daemon: Daemon) -> None:
    """Last: the drained instance takes no more requests."""
    d = daemon
    d.admin.Drain(apb.DrainRequest(instance_id="i0"), metadata=as_role("admin"), timeout=30)
    assert code_of(lambda: d.generate(req())) == C.UNAVAILABLE
