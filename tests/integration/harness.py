"""Real processes on loopback: `kvsched serve` and `kvsched worker`, started as a user would."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import grpc

from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb

REPO = Path(__file__).resolve().parents[2]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Two numpy processes on two cores slow each other 15x with one BLAS thread per core each.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class Proc:
    """A child process whose output lines are collected by a thread."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        name: str = "",
        cwd: Path = REPO,  # where `python -m kvsched.cli` finds kvsched (another checkout's)
    ) -> None:
        self.name = name or args[0]
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvsched.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(env),
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.rstrip("\n")  # one form for both: `wait_after` finds a `wait_for` match
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Wait for an output line matching `pattern` (earlier lines included)."""
        rx = re.compile(pattern)
        for line in list(self.lines):
            if m := rx.search(line):
                return m
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if m := rx.search(line):
                return m
        raise AssertionError(
            f"{self.name}: no line matching {pattern!r}; output:\n" + self.output()
        )

    def wait_after(self, line: str, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Wait for a line matching `pattern` that comes after the output line `line`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = list(self.lines)
            if line in lines:
                for later in lines[lines.index(line) + 1 :]:
                    if m := rx.search(later):
                        return m
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no {pattern!r} after {line!r}:\n" + self.output())

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_daemon(*args: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    proc = Proc(
        ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", *args], env, "daemon"
    )
    m = proc.wait_for(r"kvsched listening on (\S+:\d+)")
    return proc, m.group(1)


def start_worker(address: str, instance: str = "i0", *args: str) -> Proc:
    return Proc(
        ["worker", "--server", address, "--instance", instance, "--executor", "sim", *args],
        name=f"worker-{instance}",
    )


def status(address: str, instance: str = "") -> apb.GetStatusResponse:
    with grpc.insecure_channel(address) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        return stub.GetStatus(apb.GetStatusRequest(instance_id=instance), timeout=5)


def wait_ready(address: str, instances: Iterable[str], timeout: float = 30.0) -> None:
    want = set(instances)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = {i.instance_id for i in status(address).instances if i.ready}
        if want <= ready:
            return
        time.sleep(0.05)
    raise AssertionError(f"instances {want} not ready; status: {status(address)}")


def wait_pool_free(address: str, timeout: float = 10.0) -> apb.GetStatusResponse:
    """Wait until every instance has no requests and every KV block free; return the status."""
    deadline = time.monotonic() + timeout
    st = status(address)
    while time.monotonic() < deadline:
        st = status(address)
        if all(
            i.num_free_blocks == i.num_gpu_blocks and i.num_running == 0 and i.num_waiting == 0
            for i in st.instances
        ):
            return st
        time.sleep(0.05)
    raise AssertionError(f"KV pool not free / requests left: {st}")


def wait_hands_off(address: str, timeout: float = 30.0) -> None:
    """Until a request through `address` (a daemon whose prefill instance hands off to a peer's
    decode instance) is served: the router reads the members' addresses from a view refreshed
    every 0.2 s, so a peer the status already lists may not be routable yet ("no ready decode
    instance": UNAVAILABLE, retried). The probe (3 tokens, 2 out) is shorter than a block: it
    writes and fetches nothing."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = request_service_pb2_grpc.RequestServiceStub(channel)
        for k in range(10_000):
            probe = rpb.GenerateRequest(
                request_id=f"probe-{k}",
                prompt_token_ids=[3, 4, 5],
                sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
            )
            try:
                list(stub.Generate(probe, timeout=30))
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
