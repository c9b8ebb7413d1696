"""One daemon of three paused (SIGSTOP) or killed (kill -9) under streams of a plain grpcio
client (bench/plain_client.py: only what docs/CLIENT.md tells another language's client):
3 `kvsched serve --cluster` on one nats-server, 6 sim workers that list every daemon (their
own first), streams submitted round robin over the daemons. What the test and
`bench.plain_pause` read from it: every stream's tokens, fault -> next token per stream, which
streams moved while the paused daemon was still stopped, the convergence after SIGCONT, and
the timeline of each stream that stalled."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime

import grpc

from bench.plain_client import CHANNEL_OPTIONS, FIRST_ANSWER_TIMEOUT_S, PlainStream
from kvsched.v1 import request_service_pb2_grpc
from tests.cluster.durability_kit import Daemon, pool_free, prompts, sim_expected, start_sim_worker
from tests.cluster.heal_kit import MonitoredNats, converged
from tests.integration.harness import Proc, wait_ready

STATUS_IDS = ("pl0", "pl1", "pl2", "pl3", "pl4", "pl5")


@dataclass
class Outcome:
    fault: str
    streams: list[PlainStream]
    requests: list[tuple[str, list[int], int, int]]  # id, prompt, max_tokens, first daemon
    victim: int
    fault_at: float = 0.0  # monotonic
    fault_wall: float = 0.0  # time.time() at the fault (the daemons' log timestamps)
    woke_at: float = 0.0  # SIGCONT (stop), or the kill (kill)
    errors: list[BaseException] = field(default_factory=list)
    converged_s: float = -1.0  # SIGCONT -> every instance at the one daemon its lease names
    outputs: dict[str, str] = field(default_factory=dict)  # daemon id -> its output

    def running_at_fault(self) -> list[int]:
        """Streams that had not finished when the fault began."""
        out = []
        for i, s in enumerate(self.streams):
            done_before = s.finished is not None and s.token_times[-1] < self.fault_at
            if not done_before:
                out.append(i)
        return out

    def stall(self, i: int) -> float | None:
        """Fault -> the stream's next batch (None: none came after the fault)."""
        after = [t for t in self.streams[i].token_times if t >= self.fault_at]
        return min(after) - self.fault_at if after else None

    def exact(self) -> list[str]:
        """Ids of the streams whose tokens or finish differ from an uninterrupted run."""
        bad = []
        for (rid, p, n, _), s in zip(self.requests, self.streams, strict=True):
            fin = s.finished
            if (
                fin is None
                or fin.usage.output_tokens != n
                or s.tokens != sim_expected(rid, len(p), n)
            ):
                bad.append(rid)
        return bad

    def events(self, pattern: str = r"expired \(no refresh\)|recovered \d+ unfinished") -> str:
        """The daemons' log lines matching `pattern`, as seconds after the fault."""
        rx = re.compile(pattern)
        got = []
        for d, text in self.outputs.items():
            for line in text.splitlines():
                if rx.search(line) and line[:4].isdigit():
                    ts = datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
                    got.append(f"{ts.timestamp() - self.fault_wall:+.2f} {d}: {line[24:120]}")
        return "\n".join(sorted(got, key=lambda g: float(g.split()[0])))

    def log_of(self, i: int) -> str:
        """The daemons' log lines naming stream i's request (for a failure's report)."""
        rid = self.streams[i].request_id
        rx = re.compile(rf"\b{re.escape(rid)}\b(?!-)")
        return "\n".join(
            f"{d}: {line}"
            for d, text in self.outputs.items()
            for line in text.splitlines()
            if rx.search(line)
        )

    def timeline(self, i: int) -> str:
        s = self.streams[i]
        rel = [(round(t - (self.fault_at - s.t0), 2), d, w) for t, d, w in s.timeline]
        return f"{s.request_id} (first daemon {self.requests[i][3]}): " + "; ".join(
            f"{t:+.2f} d{d} {w}" for t, d, w in rel if t > -1.0
        )


def cluster_env(ttl_s: float) -> dict[str, str]:
    return {
        "KVSCHED_MEMBER_TTL_S": str(ttl_s),
        "KVSCHED_HEARTBEAT_INTERVAL_S": "0.5",
        "KVSCHED_HEARTBEAT_TIMEOUT_S": "3",
        "KVSCHED_SILENCE_TIMEOUT_INTERVALS": "4",  # workers leave after 2 s of silence
    }


def run(
    fault: str,
    num_streams: int,
    max_tokens: int,
    *,
    pause_s: float = 15.0,
    ttl_s: float = 6.0,
    fault_after_s: float = 4.0,
    speed: float = 0.3,
    first_answer_timeout_s: float | None = FIRST_ANSWER_TIMEOUT_S,
    seed: int = 5,
) -> Outcome:
    """The scenario once (bounded: every wait has a limit); every process stopped after."""
    assert fault in ("stop", "kill")
    nats = MonitoredNats().start()
    env = cluster_env(ttl_s)
    daemons: list[Daemon] = []
    workers: list[Proc] = []
    victim = 1
    requests = [
        (f"pl{seed}-{i}", p, max_tokens, i % 3)
        for i, p in enumerate(prompts(num_streams, seed=seed))
    ]
    out = Outcome(fault, [], requests, victim)
    try:
        daemons = [Daemon(nats.url, f"pl-d{d}", env=env).start() for d in range(3)]
        addrs = [d.address for d in daemons]
        owned = {d: [f"pl{2 * d}", f"pl{2 * d + 1}"] for d in range(3)}
        for d in range(3):
            servers = ",".join(addrs[d:] + addrs[:d])  # its own daemon first, then the others
            for iid in owned[d]:
                w_args = ("--speed", str(speed), "--reconnect-max-s", "0.5")
                workers.append(start_sim_worker(servers, iid, *w_args))
        for d in range(3):
            wait_ready(addrs[d], owned[d], 60.0)
        asyncio.run(
            asyncio.wait_for(
                _drive(out, daemons, fault, pause_s, fault_after_s, first_answer_timeout_s),
                240 + pause_s,
            )
        )
        alive = {
            d.daemon_id: d.address for i, d in enumerate(daemons) if fault == "stop" or i != victim
        }
        woke = time.monotonic()
        while not converged(nats.url, alive, list(STATUS_IDS)):
            assert time.monotonic() - woke < 60, "ownership never converged"
            time.sleep(0.1)
        out.converged_s = time.monotonic() - woke
        for a in alive.values():
            pool_free(a)
        return out
    finally:
        for d in daemons:
            out.outputs[d.daemon_id] = d.output()
        for w in reversed(workers):
            w.stop()
        for d in daemons:
            d.stop()
        nats.close()


async def _drive(
    out: Outcome,
    daemons: list[Daemon],
    fault: str,
    pause_s: float,
    fault_after_s: float,
    first_answer_timeout_s: float | None,
) -> None:
    channels = [grpc.aio.insecure_channel(d.address, options=CHANNEL_OPTIONS) for d in daemons]
    stubs = [request_service_pb2_grpc.RequestServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
    t0 = time.monotonic()
    try:
        for rid, p, n, _ in out.requests:
            out.streams.append(PlainStream(rid, p, n, first_answer_timeout_s))
        tasks = [
            asyncio.create_task(s.run(stubs, first, t0))
            for s, (_, _, _, first) in zip(out.streams, out.requests, strict=True)
        ]
        deadline = time.monotonic() + 60
        while sum(1 for s in out.streams if s.tokens) < len(out.streams):
            assert time.monotonic() < deadline, "the load never started"
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, fault_after_s - (time.monotonic() - t0)))
        proc = daemons[out.victim].proc
        assert proc is not None
        out.fault_at, out.fault_wall = time.monotonic(), time.time()
        if fault == "stop":
            proc.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(pause_s)
            finally:
                proc.signal(signal.SIGCONT)
        else:  # SIGKILL now; its exit waited for in a thread, not on this loop (the wait
            # stalled every stream here), and not the kill itself (a thread may start late)
            proc.popen.kill()
            await asyncio.to_thread(proc.popen.wait, 10)
        out.woke_at = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
        out.errors = [g for g in got if isinstance(g, BaseException)]
    finally:
        for c in channels:
            await c.close()
