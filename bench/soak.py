"""A bounded soak: real daemon and sim workers, random aborts, client disconnects, worker kills,
and (with `--daemon-kill-every S`) daemon kills.

    python -m bench.soak [--seconds 60] [--seed 0] [--daemon-kill-every 10]
                         [--json bench/results/soak.json]

For `--seconds` it keeps submitting requests (mixed lengths, shared prefixes) through Generate;
a share of them is aborted through Abort after a random delay, a share is dropped by the client
mid-stream, and every few seconds one worker process is killed with SIGKILL and restarted under
the same instance id. At the end it checks that no request was lost (every request whose client
kept listening got exactly one Finished; completed ones carry exactly the tokens the sim model
produces), that the daemon holds no request and every KV block is free, and how much the
daemon's resident memory grew. Prints a table; writes the figures as JSON.

`--daemon-kill-every S`: the daemon runs in a cluster (a nats-server with JetStream started here,
`--cluster`, its journal on) on a fixed port, and every S seconds it is killed with SIGKILL and
restarted with the same id; the clients follow their requests with kvsched.client.resumable
(Resume with the tokens they hold). The same checks hold: nothing accepted is lost, completed
requests carry exactly the sim's tokens, no block leaks. `daemon_kill_to_first_token_s` is, per
stream cut by a kill, the time from the break to its first token after the restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsched.client import (
    AsyncClient,
    Client,
    KvschedClientError,
    ResourceExhausted,
    Unavailable,
)
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, ResumableStream, resumable
from kvsched.cluster.natsd import NatsServer, free_port
from kvsched.replay.launch import Child, spawn, start_daemon
from kvsched.worker_stub.sim import SimExecutor

SIM = SimExecutor(seed=0)
WORKER_ARGS = ("--executor", "sim", "--speed", "20", "--num-blocks", "3000", "--num-slots", "64")


@dataclass
class Figures:
    seconds: float = 0.0
    requests: int = 0
    completed: int = 0
    aborted_by_rpc: int = 0
    disconnected: int = 0
    aborted_other: int = 0
    errors: int = 0
    rejected: int = 0
    worker_kills: int = 0
    lost: int = 0
    wrong_tokens: int = 0
    finished_twice: int = 0
    leaked_blocks: int = 0
    left_running_or_waiting: int = 0
    daemon_rss_start_mb: float = 0.0
    daemon_rss_end_mb: float = 0.0
    daemon_rss_samples_mb: list[float] = field(default_factory=list)  # one per worker kill
    in_flight_samples: list[int] = field(default_factory=list)  # running + waiting, same times
    daemon_kills: int = 0
    resumed: int = 0  # streams that resumed after a daemon kill
    daemon_kill_to_first_token_s: list[float] = field(default_factory=list)  # p50, p99


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def expected(req_id: str, prompt_len: int, max_tokens: int) -> list[int]:
    return [SIM.token_at(req_id, prompt_len + i) for i in range(max_tokens)]


async def one_request(
    client: AsyncClient,
    rid: str,
    rng: random.Random,
    prefixes: list[list[int]],
    fig: Figures,
    resuming: list[ResumableStream] | None = None,
) -> None:
    prompt = rng.choice(prefixes) + [rng.randrange(3, 30000) for _ in range(rng.randrange(1, 100))]
    fate = rng.random()
    # Requests meant to be aborted run long enough for the abort to land mid-stream.
    max_tokens = rng.randrange(2000, 4000) if fate < 0.2 else rng.randrange(1, 200)
    if resuming is not None and fate >= 0.1:
        await resumed_request(client, rid, prompt, max_tokens, fate, rng, fig, resuming)
        return
    try:
        stream = await client.generate(
            prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True
        )
    except (Unavailable, ResourceExhausted):
        fig.rejected += 1  # refused before acceptance (e.g. no instance ready): not lost
        return
    except KvschedClientError:
        fig.lost += 1
        return
    try:
        if fate < 0.1:  # the client drops its stream mid-way
            await asyncio.sleep(rng.random() * 0.5)
            stream.cancel()
            fig.disconnected += 1
            return
        if fate < 0.2:  # aborted through the API

            async def abort_later() -> None:
                await asyncio.sleep(rng.random() * 0.5)
                # The outcome that counts is the Finished the Generate stream receives.
                with contextlib.suppress(KvschedClientError):
                    await client.abort(rid)

            aborter = asyncio.ensure_future(abort_later())
        else:
            aborter = None
        tokens = await stream.tokens()
        if aborter is not None:
            await asyncio.gather(aborter, return_exceptions=True)
    except KvschedClientError as exc:
        if "finished twice" in exc.message:
            fig.requests += 1
            fig.finished_twice += 1
        else:
            fig.lost += 1  # accepted, and no finished record: lost
        return
    fig.requests += 1
    f = stream.finished
    assert f is not None  # stream.tokens() raises otherwise
    want = expected(rid, len(prompt), max_tokens)
    if f.reason == "length":
        fig.completed += 1
        fig.wrong_tokens += tokens != want
    elif f.reason == "abort":
        fig.aborted_by_rpc += fate < 0.2
        fig.aborted_other += fate >= 0.2
        fig.wrong_tokens += tokens != want[: len(tokens)]
    else:
        fig.errors += 1
    if f.usage.output_tokens != len(tokens):
        fig.wrong_tokens += 1


async def resumed_request(
    client: AsyncClient,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    fate: float,
    rng: random.Random,
    fig: Figures,
    resuming: list[ResumableStream],
) -> None:
    """One request followed across daemon kills (kvsched.client.resumable)."""
    stream = resumable(client, prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True)
    resuming.append(stream)
    aborter = None
    if fate < 0.2:

        async def abort_later() -> None:
            await asyncio.sleep(rng.random() * 0.5)
            with contextlib.suppress(KvschedClientError):  # e.g. the daemon is restarting
                await client.abort(rid)

        aborter = asyncio.ensure_future(abort_later())
    try:
        tokens = await stream.read_all()
    except (Unavailable, ResourceExhausted):
        if stream.accepted:
            fig.lost += 1
        else:
            fig.rejected += 1
        return
    except KvschedClientError as exc:
        fig.finished_twice += "finished twice" in exc.message
        fig.lost += "finished twice" not in exc.message
        return
    finally:
        if aborter is not None:
            await asyncio.gather(aborter, return_exceptions=True)
    fig.requests += 1
    fig.resumed += stream.resumes > 0
    f = stream.finished
    assert f is not None
    want = expected(rid, len(prompt), max_tokens)
    if f.reason == "length":
        fig.completed += 1
        fig.wrong_tokens += tokens != want
    elif f.reason == "abort":
        fig.aborted_by_rpc += fate < 0.2
        fig.aborted_other += fate >= 0.2
        fig.wrong_tokens += tokens != want[: len(tokens)]
    else:
        fig.errors += 1


async def drive(
    address: str,
    workers: dict[str, Child],
    seconds: float,
    seed: int,
    fig: Figures,
    daemon: DaemonCtl,
) -> None:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 30000) for _ in range(rng.choice((64, 256, 512)))] for _ in range(6)
    ]
    resuming: list[ResumableStream] | None = [] if daemon.kill_every_s else None
    async with AsyncClient(address, options=RESUMABLE_CHANNEL_OPTIONS) as client:
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        next_kill = start + 5.0
        next_daemon_kill = start + (daemon.kill_every_s or float("inf"))
        i = 0
        while time.monotonic() - start < seconds:
            # ~20 requests/s, below what two workers serve, so the backlog and memory stay flat
            for _ in range(rng.randrange(0, 3)):
                tasks.append(
                    asyncio.ensure_future(
                        one_request(client, f"soak-{seed}-{i}", rng, prefixes, fig, resuming)
                    )
                )
                i += 1
            if time.monotonic() >= next_kill:
                name = rng.choice(sorted(workers))
                workers[name].popen.send_signal(signal.SIGKILL)
                workers[name].popen.wait()
                workers[name] = spawn(
                    name, "worker", "--server", address, "--instance", name, *WORKER_ARGS
                )
                fig.worker_kills += 1
                fig.daemon_rss_samples_mb.append(round(rss_mb(daemon.pid), 1))
                with contextlib.suppress(KvschedClientError):  # the daemon may be restarting
                    st = await client.status()
                    fig.in_flight_samples.append(st.num_running + st.num_waiting)
                next_kill += 5.0
            if time.monotonic() >= next_daemon_kill:
                await asyncio.to_thread(daemon.kill_and_restart)
                fig.daemon_kills += 1
                next_daemon_kill += daemon.kill_every_s
            tasks = [t for t in tasks if not t.done()]
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
    if resuming:
        gaps = sorted(t for s in resuming for t in s.first_token_after_break)
        if gaps:
            p99 = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))]
            fig.daemon_kill_to_first_token_s = [
                round(gaps[(len(gaps) - 1) // 2], 3),
                round(p99, 3),
            ]


class DaemonCtl:
    """The soak's daemon; with kill_every_s, in a cluster with its journal, on a fixed port,
    killed with SIGKILL and restarted with the same id."""

    def __init__(self, kill_every_s: float) -> None:
        self.kill_every_s = kill_every_s
        self.nats = NatsServer().start() if kill_every_s else None
        self.args: tuple[str, ...] = ()
        if self.nats is not None:
            port = free_port()
            self.args = ("--listen", f"127.0.0.1:{port}", "--cluster", self.nats.url)
            self.args += ("--daemon-id", "soak")
        self.child, self.address = start_daemon(*self.args)

    @property
    def pid(self) -> int:
        return self.child.popen.pid

    def kill_and_restart(self) -> None:
        self.child.popen.send_signal(signal.SIGKILL)
        self.child.popen.wait()
        self.child, self.address = start_daemon(*self.args)

    def stop(self) -> None:
        self.child.stop()
        if self.nats is not None:
            self.nats.close()


def soak(seconds: float = 60.0, seed: int = 0, daemon_kill_every_s: float = 0.0) -> Figures:
    fig = Figures(seconds=seconds)
    daemon = DaemonCtl(daemon_kill_every_s)
    address = daemon.address
    workers = {
        n: spawn(n, "worker", "--server", address, "--instance", n, *WORKER_ARGS)
        for n in ("a", "b")
    }
    try:
        for w in workers.values():
            w.wait_for("welcomed")
        time.sleep(0.5)
        fig.daemon_rss_start_mb = rss_mb(daemon.pid)
        asyncio.run(drive(address, workers, seconds, seed, fig, daemon))
        fig.daemon_rss_end_mb = rss_mb(daemon.pid)
        if daemon.kill_every_s:  # a restarted daemon: wait for its workers to be back
            wait_workers(address, len(workers))
        with Client(address, timeout=10) as client:
            st = client.status()
        for inst in st.instances:
            if inst.ready:
                fig.leaked_blocks += inst.num_gpu_blocks - inst.num_free_blocks
        fig.left_running_or_waiting = st.num_running + st.num_waiting
    finally:
        for w in workers.values():
            w.stop()
        daemon.stop()
    return fig


def wait_workers(address: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(KvschedClientError), Client(address, timeout=5) as client:
            if sum(i.ready for i in client.status().instances) >= n:
                return
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--daemon-kill-every",
        type=float,
        default=0.0,
        metavar="S",
        help="kill -9 and restart the daemon (in a cluster, journal on) every S seconds",
    )
    ap.add_argument("--json", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()
    fig = soak(args.seconds, args.seed, args.daemon_kill_every)
    for k, v in asdict(fig).items():
        print(f"{k:<28} {v:.1f}" if isinstance(v, float) else f"{k:<28} {v}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(asdict(fig), indent=2) + "\n")
    bad = (
        fig.lost
        + fig.wrong_tokens
        + fig.finished_twice
        + fig.leaked_blocks
        + fig.left_running_or_waiting
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
