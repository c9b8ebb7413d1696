"""The transport benchmark's running parts (bench/transport.py): the daemon, one zero-cost sim
worker and an optional OTLP sink started as child processes, the Session front end in this
process that keeps R requests running, and one measured window (`run_case`). Also used by
bench.fleet, bench.span_cost and bench.journal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import random
import re
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsched.client import AsyncClient, AsyncSession, KvschedClientError
from kvsched.replay.launch import Child

DEFAULT_JSON = Path(__file__).parent / "results" / "transport.json"
BLOCK_SIZE = 64
NUM_BLOCKS = 1 << 20  # never the limit: R x (tokens one request makes in the run) / 64 is far less
PROMPT_LEN = 32
MAX_TOKENS = 100_000  # under max_model_len (131072); at 4,000 steps/s that is 25 s of decoding
TARGET_STEPS_PER_S = {256: 2000.0, 1024: 600.0}
TARGET_CPU_US_PER_STEP = {1024: 1000.0}
TARGET_TRACING_RATIO = 0.90
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- child processes ------------------------------------------------------------------------


def spawn(name: str, argv: list[str], env: dict[str, str], cwd: str | None = None) -> Child:
    """Start `python argv...` with stdout+stderr pumped into a Child (kvsched.replay.launch).
    `cwd`: run it there (`python -m kvsched.cli` then imports the kvsched found there first:
    bench.journal's `--old-src`, another checkout of the daemon, side by side)."""
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
        cwd=cwd,
    )
    child = Child(name, popen)
    threading.Thread(target=child.pump, daemon=True).start()
    return child


def cpu_s(pid: int) -> float:
    """utime + stime of process `pid`, all threads, in seconds (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine spent busy (not idle or waiting on I/O)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLK_TCK


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

    def stop(self) -> dict[str, Any]:
        """Stop worker, daemon, sink (in that order). Returns what their last lines tell: the
        worker's tokens per step over its whole run (below R: steps ran with paused slots) and
        the spans the sink received."""
        out: dict[str, Any] = {}
        self.worker.stop()
        self.daemon.stop()
        if self.sink is not None:
            self.sink.stop()
        time.sleep(0.2)  # let the pump threads take the last lines
        if m := last_match(
            self.worker,
            r"worker stats: (\d+) steps, (\d+) tokens, \d+ prompt tokens computed, (\d+) paused",
        ):
            out["worker_paused_rows"] = int(m.group(3))
            steps, tokens = int(m.group(1)), int(m.group(2))
            out["worker_tokens_per_step"] = round(tokens / steps, 1) if steps else 0.0
        if self.sink is not None:
            m = last_match(self.sink, r"otlp sink: \d+ export requests, (\d+) spans")
            out["otlp_spans_received"] = int(m.group(1)) if m else 0
        return out


def last_match(child: Child, pattern: str) -> re.Match[str] | None:
    for line in reversed(child.lines):
        if m := re.search(pattern, line):
            return m
    return None


def start_stack(
    running: int,
    tracing: str,
    daemon_env: dict[str, str] | None = None,
    daemon_cwd: str | None = None,
) -> Stack:
    """Start sink (when tracing), daemon and worker; on a failure, stop what was started.
    `daemon_env`: more KVSCHED_* settings for the daemon (bench.journal: the cluster);
    `daemon_cwd`: the daemon's source tree when not this one (see `spawn`)."""
    started: list[Child] = []
    try:
        return _start_stack(running, tracing, started, daemon_env or {}, daemon_cwd)
    except BaseException:
        for child in reversed(started):
            child.stop()
        raise


def _start_stack(
    running: int,
    tracing: str,
    started: list[Child],
    daemon_env: dict[str, str],
    daemon_cwd: str | None = None,
) -> Stack:
    sink = None
    env = {
        "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_SEQS": str(running),
        "KVSCHED_GRACE_PERIOD_S": "2",
        **daemon_env,
    }
    if tracing == "otlp":
        sink = spawn("otlp-sink", ["-m", "bench.otlp_sink", "--listen", "127.0.0.1:0"], {})
        started.append(sink)
        env["KVSCHED_OTLP_ENDPOINT"] = sink.wait_for(r"otlp sink listening on (\S+:\d+)").group(1)
    serve = ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]
    profile = os.environ.get("KVSCHED_BENCH_PROFILE_DAEMON")  # cProfile output path
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    daemon = spawn(
        "daemon",
        [*prof, "-m", "kvsched.cli", *serve, "--log-level", "warning", "--tracing", tracing],
        env,
        daemon_cwd,
    )
    started.append(daemon)
    address = daemon.wait_for(r"kvsched listening on (\S+:\d+)").group(1)
    worker_args = [
        *("worker", "--server", address, "--instance", "i0", "--executor", "sim", "--zero-cost"),
        *("--num-slots", str(running), "--num-blocks", str(NUM_BLOCKS)),
        *("--block-size", str(BLOCK_SIZE)),
    ]
    worker = spawn(
        "worker",
        ["-m", "kvsched.cli", *worker_args],
        {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    started.append(worker)
    worker.wait_for(r"welcomed")
    return Stack(daemon, worker, sink, address)


# ---- the front end --------------------------------------------------------------------------


class FrontEnd:
    """Session streams that keep `running` requests running: one new request per finished one.
    Per message it only counts, from the message's own columns (`batch.raw`): the front end must
    cost little next to the daemon."""

    def __init__(self, client: AsyncClient, running: int, sessions: int, max_tokens: int) -> None:
        self.client = client
        self.running = running
        self.num_sessions = sessions
        self.max_tokens = max_tokens
        self.sessions: list[AsyncSession] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.rng = random.Random(0)
        self.num_submitted = 0
        self.num_tokens = 0
        self.num_messages = 0
        self.num_finished = 0
        self.errors: list[str] = []
        self.closing = False

    async def start(self) -> None:
        self.sessions = [self.client.session() for _ in range(self.num_sessions)]
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._read(s)) for s in self.sessions]
        for i in range(self.running):
            await self.submit(self.sessions[i % len(self.sessions)])

    async def submit(self, session: AsyncSession) -> None:
        rid = f"t{self.num_submitted}"
        self.num_submitted += 1
        prompt = [self.rng.randrange(3, 30000) for _ in range(PROMPT_LEN)]
        await session.submit(
            prompt, client_tag=rid, request_id=rid, max_tokens=self.max_tokens, ignore_eos=True
        )

    async def _read(self, session: AsyncSession) -> None:
        try:
            async for batch in session:
                msg = batch.raw
                self.num_messages += 1
                self.num_tokens += len(msg.tokens.token_ids)
                for _ in msg.finished:
                    self.num_finished += 1
                    if not self.closing:
                        await self.submit(session)
                for e in msg.errors:
                    self.errors.append(f"{e.client_tag or e.request_id}: {e.code} {e.message}")
        except KvschedClientError as exc:
            if not self.closing:
                self.errors.append(f"Session stream: {exc}")

    async def close(self) -> None:
        """Cancel the streams: the daemon aborts their requests (they are not detachable)."""
        self.closing = True
        for session in self.sessions:
            session.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ---- one case -------------------------------------------------------------------------------


class NotRunning(RuntimeError):
    """The front end's requests did not all start within the ramp's time bound."""


async def wait_running(
    admin: AsyncClient, fe: FrontEnd, running: int, timeout: float = 120.0
) -> None:
    """Until the batch is full: `running` requests running and none waiting, or, when requests
    turn over (short ones: some are always between their end and their successor's accept),
    `running` of them finished since the start (the batch has turned over once). Polled every
    0.5 s: a cluster daemon's GetStatus costs CPU (the prefix index's digests)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await admin.status()
        if (st.num_running == running and st.num_waiting == 0) or fe.num_finished >= running:
            return
        if fe.errors:
            raise RuntimeError(f"front end errors: {fe.errors[:3]}")
        if time.monotonic() > deadline:
            raise NotRunning(
                f"{running} requests not all running after {timeout:.0f} s "
                f"(running {st.num_running}, waiting {st.num_waiting}, "
                f"{fe.num_finished} finished)"
            )
        await asyncio.sleep(0.5)


async def wait_idle(admin: AsyncClient, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await admin.status()
        if st.num_running == 0 and st.num_waiting == 0:
            return
        await asyncio.sleep(0.1)


@dataclass
class Snapshot:
    t: float
    tokens: int
    messages: int
    finished: int
    schedules: int
    daemon_cpu: float
    worker_cpu: float
    self_cpu: float
    sink_cpu: float
    machine_busy: float

    @classmethod
    async def take(cls, admin: AsyncClient, fe: FrontEnd, stack: Stack) -> Snapshot:
        st = await admin.status()
        return cls(
            time.monotonic(),
            fe.num_tokens,
            fe.num_messages,
            fe.num_finished,
            sum(i.num_steps for i in st.instances),
            cpu_s(stack.daemon.popen.pid),
            cpu_s(stack.worker.popen.pid),
            self_cpu_s(),
            cpu_s(stack.sink.popen.pid) if stack.sink is not None else 0.0,
            machine_busy_s(),
        )


async def measure(
    stack: Stack,
    running: int,
    seconds: float,
    warmup: float,
    sessions: int,
    max_tokens: int,
    ramp_s: float = 120.0,
) -> dict[str, Any]:
    async with AsyncClient(stack.address, timeout=None) as admin:
        fe = FrontEnd(admin, running, sessions, max_tokens)
        try:
            await fe.start()
            await wait_running(admin, fe, running, ramp_s)
            await asyncio.sleep(warmup)
            a = await Snapshot.take(admin, fe, stack)
            await asyncio.sleep(seconds)
            b = await Snapshot.take(admin, fe, stack)
            st = await admin.status()
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
        # Per step the daemon scheduled (the batch may run below R while requests turn over).
        "daemon_cpu_us_per_schedule": round(
            1e6 * (b.daemon_cpu - a.daemon_cpu) / max(1, b.schedules - a.schedules), 1
        ),
        "daemon_reports_per_s": round(sum(i.steps_per_s for i in st.instances), 1),
        "daemon_cpu_frac": round((b.daemon_cpu - a.daemon_cpu) / dt, 3),
        "worker_cpu_us_per_step": round((b.worker_cpu - a.worker_cpu) * per_step_us, 1),
        "frontend_cpu_us_per_step": round((b.self_cpu - a.self_cpu) * per_step_us, 1),
        "sink_cpu_us_per_step": round((b.sink_cpu - a.sink_cpu) * per_step_us, 1),
        "other_load_cores": round(other_load(a, b) / dt, 2),
        "finished_in_window": b.finished - a.finished,
        "daemon_cpu_us_per_finished": round(
            1e6 * (b.daemon_cpu - a.daemon_cpu) / max(1, b.finished - a.finished), 1
        ),
        "session_messages_per_s": round((b.messages - a.messages) / dt, 1),
        "running_at_end": st.num_running,
        "seconds": round(dt, 2),
        "sessions": sessions,
        "max_tokens": max_tokens,
    }


def other_load(a: Snapshot, b: Snapshot) -> float:
    """CPU seconds the machine was busy outside this benchmark's processes."""
    ours = (
        (b.daemon_cpu - a.daemon_cpu)
        + (b.worker_cpu - a.worker_cpu)
        + (b.self_cpu - a.self_cpu)
        + (b.sink_cpu - a.sink_cpu)
    )
    return max(0.0, b.machine_busy - a.machine_busy - ours)


def run_case(
    running: int,
    tracing: str,
    seconds: float,
    warmup: float,
    sessions: int,
    max_tokens: int,
    daemon_env: dict[str, str] | None = None,
    daemon_cwd: str | None = None,
    ramp_s: float = 120.0,
) -> dict[str, Any]:
    stack = start_stack(running, tracing, daemon_env, daemon_cwd)
    extra: dict[str, Any] = {}
    try:
        rec = asyncio.run(measure(stack, running, seconds, warmup, sessions, max_tokens, ramp_s))
    finally:
        extra = stack.stop()
    rec["tracing"] = tracing
    rec.update(extra)
    return rec


# ---- the daemon's Python hot path, without gRPC ------------------------------------------------


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores ({model or platform.machine()}), Python {platform.python_version()}"
