"""Transport benchmark: how many engine steps per second the daemon sustains with every token
streamed to clients, and what each step costs the daemon's CPU.

    python -m bench.transport [--running 256,1024] [--seconds 10] [--tracing none|otlp]
                              [--json bench/results/transport.json]

For each R it starts, as child processes, the real daemon (`kvsched serve`), ONE zero-cost sim
worker with R slots, and (with `--tracing otlp`) an OTLP/gRPC sink (`bench.otlp_sink`) the
daemon exports to. This process runs the front end: Session streams that keep exactly R requests
running (distinct short prompts, max_tokens long enough to decode through the whole window, a
new request submitted whenever one finishes). After all R run and a warm-up, one window of
`--seconds` is measured:

    steps_per_s             tokens delivered to the front end / R / window: engine steps in
                            which every running request got its token to its client
    daemon_cpu_us_per_step  the daemon's utime + stime (/proc/PID/stat, all its threads) over
                            the window / those steps
    tokens_per_s            token events received by the front end / window
    daemon_schedules_per_s  AdminService GetStatus num_steps delta: schedule() calls. Lower than
                            steps_per_s when the daemon folds several worker reports into one
                            schedule() (it does so whenever it falls behind)

The worker and the front end's CPU per step are recorded too: on a small machine all processes
share the same cores, so the step rate is bounded by their sum, not the daemon's alone.

`--tracing otlp` runs every R twice, tracing `none` then `otlp`, in the same invocation, and
prints otlp / none steps/s (target: >= 0.90). Tracing costs per request (a span per request,
no span per step or token), so with long requests it measures the idle exporter's overhead;
`--max-tokens` lower makes requests turn over and prices the spans too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import resource
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvsched.replay.launch import Child
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb

DEFAULT_JSON = Path(__file__).parent / "results" / "transport.json"
BLOCK_SIZE = 64
NUM_BLOCKS = 1 << 20  # never the limit: R x (tokens one request makes in the run) / 64 is far less
PROMPT_LEN = 32
MAX_TOKENS = 100_000  # under max_model_len (131072); at 4,000 steps/s that is 25 s of decoding
TARGET_STEPS_PER_S = {256: 2000.0, 1024: 600.0}
TARGET_CPU_US_PER_STEP = {1024: 1000.0}
TARGET_TRACING_RATIO = 0.90
CLK_TCK = os.sysconf("SC_CLK_TCK")
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


# ---- child processes ------------------------------------------------------------------------


def spawn(name: str, argv: list[str], env: dict[str, str]) -> Child:
    """Start `python argv...` with stdout+stderr pumped into a Child (kvsched.replay.launch)."""
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    for var in list(full_env):  # the bench decides tracing, not the caller's shell
        if var.startswith("OTEL_"):
            del full_env[var]
    popen = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )
    child = Child(name, popen)
    threading.Thread(target=child.pump, daemon=True).start()
    return child


def cpu_s(pid: int) -> float:
    """utime + stime of process `pid`, all threads, in seconds (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class Stack:
    """The daemon, its worker and (when tracing) the OTLP sink, for one case."""

    daemon: Child
    worker: Child
    sink: Child | None
    address: str

    def stop(self) -> int | None:
        """Stop worker, daemon, sink (in that order); the sink's span count, if any."""
        self.worker.stop()
        self.daemon.stop()
        if self.sink is None:
            return None
        self.sink.stop()
        self.sink.popen.wait(10)
        time.sleep(0.1)  # let the pump thread take the last line
        for line in reversed(self.sink.lines):
            if m := re.search(r"otlp sink: \d+ export requests, (\d+) spans", line):
                return int(m.group(1))
        return 0


def start_stack(running: int, tracing: str) -> Stack:
    sink = None
    env = {
        "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQS": str(running),
        "KVSCHED_GRACE_PERIOD_S": "2",
    }
    if tracing == "otlp":
        sink = spawn("otlp-sink", ["-m", "bench.otlp_sink", "--listen", "127.0.0.1:0"], {})
        endpoint = sink.wait_for(r"otlp sink listening on (\S+:\d+)").group(1)
        env["KVSCHED_OTLP_ENDPOINT"] = endpoint
    daemon = spawn(
        "daemon",
        [
            "-m",
            "kvsched.cli",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--log-level",
            "warning",
            "--tracing",
            tracing,
        ],
        env,
    )
    address = daemon.wait_for(r"kvsched listening on (\S+:\d+)").group(1)
    worker = spawn(
        "worker",
        [
            "-m",
            "kvsched.cli",
            "worker",
            "--server",
            address,
            "--instance",
            "i0",
            "--executor",
            "sim",
            "--zero-cost",
            "--num-slots",
            str(running),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
        ],
        {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    worker.wait_for(r"welcomed")
    return Stack(daemon, worker, sink, address)


# ---- the front end --------------------------------------------------------------------------


class FrontEnd:
    """Session streams that keep `running` requests running: one new request per finished one.
    Per message it only counts: the front end must cost little next to the daemon."""

    def __init__(
        self, channel: grpc.aio.Channel, running: int, sessions: int, max_tokens: int
    ) -> None:
        self.stub = request_service_pb2_grpc.RequestServiceStub(channel)
        self.running = running
        self.max_tokens = max_tokens
        self.queues: list[asyncio.Queue[rpb.SessionRequest | None]] = [
            asyncio.Queue() for _ in range(sessions)
        ]
        self.calls: list[Any] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.rng = random.Random(0)
        self.num_submitted = 0
        self.num_tokens = 0
        self.num_messages = 0
        self.num_finished = 0
        self.errors: list[str] = []
        self.closing = False

    def start(self) -> None:
        for i in range(self.running):
            self.submit(self.queues[i % len(self.queues)])
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._read(q)) for q in self.queues]

    def submit(self, queue: asyncio.Queue[rpb.SessionRequest | None]) -> None:
        rid = f"t{self.num_submitted}"
        self.num_submitted += 1
        prompt = [self.rng.randrange(3, 30000) for _ in range(PROMPT_LEN)]
        request = rpb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
        )
        queue.put_nowait(
            rpb.SessionRequest(submit=rpb.SessionRequest.Submit(request=request, client_tag=rid))
        )

    async def _requests(
        self, queue: asyncio.Queue[rpb.SessionRequest | None]
    ) -> AsyncIterator[rpb.SessionRequest]:
        while (msg := await queue.get()) is not None:
            yield msg

    async def _read(self, queue: asyncio.Queue[rpb.SessionRequest | None]) -> None:
        call = self.stub.Session(self._requests(queue))
        self.calls.append(call)
        try:
            async for msg in call:
                self.num_messages += 1
                self.num_tokens += len(msg.tokens.token_ids)
                for _ in msg.finished:
                    self.num_finished += 1
                    if not self.closing:
                        self.submit(queue)
                for e in msg.errors:
                    self.errors.append(f"{e.client_tag or e.request_id}: {e.code} {e.message}")
        except grpc.aio.AioRpcError as exc:
            if not self.closing:
                self.errors.append(f"Session stream: {exc.code().name}: {exc.details()}")

    async def close(self) -> None:
        """Cancel the streams: the daemon aborts their requests (they are not detachable)."""
        self.closing = True
        for call in self.calls:
            call.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ---- one case -------------------------------------------------------------------------------


async def wait_running(admin: Any, fe: FrontEnd, running: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        st = await admin.GetStatus(apb.GetStatusRequest())
        if st.num_running == running and st.num_waiting == 0:
            return
        if fe.errors:
            raise RuntimeError(f"front end errors: {fe.errors[:3]}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{running} requests not all running after {timeout:.0f} s "
                f"(running {st.num_running}, waiting {st.num_waiting})"
            )
        await asyncio.sleep(0.1)


async def wait_idle(admin: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await admin.GetStatus(apb.GetStatusRequest())
        if st.num_running == 0 and st.num_waiting == 0:
            return
        await asyncio.sleep(0.1)


@dataclass
class Snapshot:
    t: float
    tokens: int
    messages: int
    schedules: int
    daemon_cpu: float
    worker_cpu: float
    self_cpu: float

    @classmethod
    async def take(cls, admin: Any, fe: FrontEnd, stack: Stack) -> Snapshot:
        st = await admin.GetStatus(apb.GetStatusRequest())
        return cls(
            time.monotonic(),
            fe.num_tokens,
            fe.num_messages,
            sum(i.num_steps for i in st.instances),
            cpu_s(stack.daemon.popen.pid),
            cpu_s(stack.worker.popen.pid),
            self_cpu_s(),
        )


async def measure(
    stack: Stack, running: int, seconds: float, warmup: float, sessions: int, max_tokens: int
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(stack.address, options=CHANNEL_OPTIONS) as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        fe = FrontEnd(channel, running, sessions, max_tokens)
        fe.start()
        try:
            await wait_running(admin, fe, running)
            await asyncio.sleep(warmup)
            a = await Snapshot.take(admin, fe, stack)
            await asyncio.sleep(seconds)
            b = await Snapshot.take(admin, fe, stack)
            st = await admin.GetStatus(apb.GetStatusRequest())
        finally:
            await fe.close()
        await wait_idle(admin)
    if fe.errors:
        raise RuntimeError(f"front end errors: {fe.errors[:3]}")
    dt = b.t - a.t
    tokens = b.tokens - a.tokens
    steps = tokens / running
    per_step_us = 1e6 / steps if steps else float("inf")
    return {
        "running": running,
        "steps_per_s": round(steps / dt, 1),
        "daemon_cpu_us_per_step": round((b.daemon_cpu - a.daemon_cpu) * per_step_us, 1),
        "tokens_per_s": round(tokens / dt),
        "daemon_schedules_per_s": round((b.schedules - a.schedules) / dt, 1),
        "daemon_cpu_frac": round((b.daemon_cpu - a.daemon_cpu) / dt, 3),
        "worker_cpu_us_per_step": round((b.worker_cpu - a.worker_cpu) * per_step_us, 1),
        "frontend_cpu_us_per_step": round((b.self_cpu - a.self_cpu) * per_step_us, 1),
        "session_messages_per_s": round((b.messages - a.messages) / dt, 1),
        "running_at_end": st.num_running,
        "seconds": round(dt, 2),
        "sessions": sessions,
        "max_tokens": max_tokens,
    }


def run_case(
    running: int, tracing: str, seconds: float, warmup: float, sessions: int, max_tokens: int
) -> dict[str, Any]:
    stack = start_stack(running, tracing)
    spans = None
    try:
        rec = asyncio.run(measure(stack, running, seconds, warmup, sessions, max_tokens))
    finally:
        spans = stack.stop()
    rec["tracing"] = tracing
    if spans is not None:
        rec["otlp_spans_received"] = spans
    return rec


# ---- report ---------------------------------------------------------------------------------


def verdict(rec: dict[str, Any]) -> tuple[str, str, str]:
    """(steps target, cpu target, PASS/MISS) for one record."""
    r = rec["running"]
    ok = True
    steps_t = cpu_t = "-"
    if r in TARGET_STEPS_PER_S:
        steps_t = f">= {TARGET_STEPS_PER_S[r]:,.0f}"
        ok &= rec["steps_per_s"] >= TARGET_STEPS_PER_S[r]
    if r in TARGET_CPU_US_PER_STEP:
        cpu_t = f"<= {TARGET_CPU_US_PER_STEP[r]:,.0f}"
        ok &= rec["daemon_cpu_us_per_step"] <= TARGET_CPU_US_PER_STEP[r]
    has_target = r in TARGET_STEPS_PER_S or r in TARGET_CPU_US_PER_STEP
    return steps_t, cpu_t, ("PASS" if ok else "MISS") if has_target else "-"


def print_table(records: list[dict[str, Any]]) -> None:
    head = (
        f"{'tracing':>7} {'running':>7} {'steps/s':>9} {'target':>8} {'daemon us/step':>14} "
        f"{'target':>8} {'tokens/s':>10} {'sched/s':>8} {'worker us':>9} {'front us':>8}  result"
    )
    print(head)
    print("-" * len(head))
    for rec in records:
        steps_t, cpu_t, ok = verdict(rec)
        print(
            f"{rec['tracing']:>7} {rec['running']:>7} {rec['steps_per_s']:>9,.0f} {steps_t:>8} "
            f"{rec['daemon_cpu_us_per_step']:>14,.0f} {cpu_t:>8} {rec['tokens_per_s']:>10,} "
            f"{rec['daemon_schedules_per_s']:>8,.0f} {rec['worker_cpu_us_per_step']:>9,.0f} "
            f"{rec['frontend_cpu_us_per_step']:>8,.0f}  {ok}"
        )


def print_tracing_ratio(records: list[dict[str, Any]]) -> None:
    by = {(r["tracing"], r["running"]): r for r in records}
    rows = [
        (n, by[("none", n)], by[("otlp", n)]) for t, n in by if t == "otlp" and ("none", n) in by
    ]
    if not rows:
        return
    print()
    print(f"tracing cost: otlp / none steps/s (target >= {TARGET_TRACING_RATIO:.2f})")
    for n, none, otlp in rows:
        ratio = otlp["steps_per_s"] / none["steps_per_s"] if none["steps_per_s"] else 0.0
        cpu = otlp["daemon_cpu_us_per_step"] - none["daemon_cpu_us_per_step"]
        ok = "PASS" if ratio >= TARGET_TRACING_RATIO else "MISS"
        spans = otlp.get("otlp_spans_received", 0)
        print(
            f"  running {n:>5}: {otlp['steps_per_s']:,.0f} / {none['steps_per_s']:,.0f} = "
            f"{ratio:.3f}  ({cpu:+,.0f} daemon us/step; sink received {spans} spans)  {ok}"
        )


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores ({model or platform.machine()}), Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", default="256,1024", help="running batch sizes, comma separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per case")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after all R run")
    ap.add_argument("--tracing", choices=("none", "otlp"), default="none")
    ap.add_argument("--sessions", type=int, default=1, help="Session streams in the front end")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="per request")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the records")
    args = ap.parse_args()
    sizes = [int(x) for x in args.running.split(",") if x.strip()]
    modes = ["none", "otlp"] if args.tracing == "otlp" else ["none"]
    print(
        f"kvsched transport: daemon + 1 zero-cost sim worker + {args.sessions} Session stream(s), "
        f"{args.seconds:g} s window per case"
    )
    print(
        f"machine: {machine()}; daemon, worker, front end"
        + (" and OTLP sink" if args.tracing == "otlp" else "")
        + " share these cores: figures are noisy and bound by the sum of their CPU per step"
    )
    records = []
    for n in sizes:
        for mode in modes:  # none and otlp back to back per R, so drift hits both alike
            rec = run_case(n, mode, args.seconds, args.warmup, args.sessions, args.max_tokens)
            print(
                f"  running {n} tracing {mode}: {rec['steps_per_s']:,.0f} steps/s, "
                f"{rec['daemon_cpu_us_per_step']:,.0f} daemon us/step",
                flush=True,
            )
            records.append(rec)
    print()
    print_table(records)
    print_tracing_ratio(records)
    print(
        "\nsteps/s: tokens delivered / running / s. sched/s: the daemon's schedule() calls. "
        "worker us, front us: their CPU per step."
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
