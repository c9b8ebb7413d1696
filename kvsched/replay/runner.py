"""Replay trace requests against a daemon over Session streams (one by default), at their
arrival times.

Wall times are divided by `time_scale` (pair it with the sim worker's `--speed`), so every
measured latency is multiplied back by it: figures are in simulated GPU seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsched.client import (
    AsyncClient,
    AsyncSession,
    KvschedClientError,
    PermissionDenied,
    SessionBatch,
    Unauthenticated,
)
from kvsched.client.types import build_submit
from kvsched.replay.fit import unfit, warn_unfit
from kvsched.replay.summary import RequestRecord
from kvsched.traces import TraceRequest
from kvsched.v1 import admin_service_pb2 as apb

BUILD_AHEAD_S = 0.05  # wall seconds: requests due this soon after the next are built with it
HEADER_WAIT_S = 2.0  # at most, for a Session's initial metadata before the replay starts


@dataclass
class DaemonSample:
    """One daemon's share of a sample: its own instances, and the output tokens of the
    requests sent through it."""

    running: int
    waiting: int
    kv_usage: float
    tokens_per_s: float


@dataclass
class Sample:
    t_s: float
    running: int
    waiting: int
    kv_usage: float
    tokens_per_s: float
    daemons: list[DaemonSample] = field(default_factory=list)  # in --server order


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    timeline: list[Sample] = field(default_factory=list)
    preemptions: int = 0
    num_gpu_blocks: int = 0
    num_host_blocks: int = 0  # each instance's host tier (the first ready one's)
    host_hit_tokens: int = 0  # prompt tokens swapped in from host tiers during the run
    storage_hit_tokens: int = 0  # prompt tokens fetched from the storage tier during the run
    prefetched_hit_tokens: int = 0  # of those, prefetched to host before placement (swapped in)
    block_size: int = 0
    instances: list[dict[str, Any]] = field(default_factory=list)
    # Requests no ready instance could hold when the replay started: (request id, KV blocks
    # its prompt needs); the daemon refuses them (the records say how).
    unfit: list[tuple[str, int]] = field(default_factory=list)
    daemons: list[str] = field(default_factory=list)  # names (cluster daemon id or address)
    t0_wall_ns: int = 0  # the replay's start (arrival 0) on the wall clock, for daemon spans


class _Run:
    def __init__(self, requests: Sequence[TraceRequest], rate_scale: float, time_scale: float):
        self.requests = requests
        self.speedup = rate_scale * time_scale  # arrival offsets are divided by this
        self.time_scale = time_scale
        self.t0 = 0.0
        self.records = {
            f"trace-{i}": RequestRecord(
                f"trace-{i}",
                r.arrival_s / rate_scale,
                len(r.prompt_token_ids),
                r.max_tokens,
            )
            for i, r in enumerate(requests)
        }
        self.done = 0
        self.tokens = 0
        self.tokens_by_daemon: list[int] = []  # output tokens read per session (daemon)
        self.num_progress = 0
        self.finished = asyncio.Event()

    def now(self) -> float:
        """Seconds since the start, in trace (simulated GPU) time."""
        return (time.monotonic() - self.t0) * self.time_scale

    async def submit_all(self, sessions: Sequence[AsyncSession]) -> None:
        """Submit every request at its arrival time (request i on session i mod n: spread
        over a cluster's daemons, session j being on daemon j mod their number), then
        half-close the sessions. Requests are built (their prompts encoded) before the wait for
        the first of them due within BUILD_AHEAD_S, so a burst of arrivals (the Mooncake
        traces' arrivals come every 3 s, up to 20 at once) goes out back to back, not behind
        each other's encoding; and every request due by then (a burst arriving together, or
        any the submitter fell behind on) goes out at once, those of one session in one
        message (AsyncSession.submit_many_built), read by the daemon at once."""
        n, reqs = len(sessions), self.requests
        built: dict[int, Any] = {}
        ahead = 0  # the next request to build
        i = 0  # the next request to send
        while i < len(reqs):
            horizon = reqs[i].arrival_s / self.speedup + BUILD_AHEAD_S
            while ahead < len(reqs) and reqs[ahead].arrival_s / self.speedup <= horizon:
                built[ahead] = self._build(ahead)
                ahead += 1
            delay = self.t0 + reqs[i].arrival_s / self.speedup - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            due, now = i + 1, time.monotonic()
            while due < len(reqs) and self.t0 + reqs[due].arrival_s / self.speedup <= now:
                due += 1
            by_session: dict[int, list[int]] = {}
            for k in range(i, due):
                by_session.setdefault(k % n, []).append(k)
            for j, ks in by_session.items():
                msgs = [built.pop(k) if k in built else self._build(k) for k in ks]
                await sessions[j].submit_many_built(msgs)
                sent = self.now()
                for k in ks:
                    self.records[f"trace-{k}"].sent_s = sent
            i, ahead = due, max(ahead, due)
        for session in sessions:
            await session.close()

    def _build(self, i: int) -> Any:
        """Request i's submit, its prompt encoded."""
        q, tag = self.requests[i], f"trace-{i}"
        opts = {"request_id": tag, "max_tokens": q.max_tokens, "ignore_eos": True}
        return build_submit(q.prompt_token_ids, opts, tag)  # type: ignore[arg-type]

    def absorb(self, batch: SessionBatch, daemon: int = 0) -> None:
        now = self.now()
        records = self.records
        pos = 0
        for rid, n in batch.token_counts():
            rec = records[rid]
            if rec.first_token_s is None:
                rec.first_token_s = now
            rec.token_times_s.extend([now] * n)
            pos += n
        self.tokens += pos
        if daemon < len(self.tokens_by_daemon):
            self.tokens_by_daemon[daemon] += pos
        for f in batch.finished:
            rec = records[f.request_id]
            rec.finish_s = now
            rec.finish_reason = f.reason
            rec.message = f.message
            rec.num_cached_tokens = f.usage.cached_tokens
            self._count_done()
        for e in batch.errors:
            rec = records.get(e.client_tag)
            if rec is not None and not rec.finish_reason:
                rec.finish_reason = "rejected"
                exc = e.exception()
                rec.message = f"{exc.code.name}: {exc.message}"
                self._count_done()

    def _count_done(self) -> None:
        self.done += 1
        if self.done == len(self.records):
            self.finished.set()


async def replay(
    address: str,
    requests: Sequence[TraceRequest],
    *,
    rate_scale: float = 1.0,
    time_scale: float = 1.0,
    progress: bool = True,
    token: str = "",
    credentials: Any = None,
    sample_every_s: float = 1.0,
    admin_token: str | None = None,
    streams: int = 1,
) -> ReplayResult:
    """Replay `requests` over `streams` Sessions per daemon (`address`: one HOST:PORT, or a
    cluster's daemons comma-separated; requests spread round-robin over the daemons, then over
    each daemon's streams), with `token`: the client's. One stream carries a burst of arrivals
    one message after another, each read in its own turn of the daemon's event loop (between
    them the daemon serves everything else); N streams, like N clients, reach it together. Status figures (preemptions, KV usage, the timeline) come from AdminService with
    `admin_token` (default: `token`), summed over the daemons; a daemon that refuses those
    credentials there gets a replay without them. KvschedClientError when a daemon refuses the
    session or cannot be reached."""
    if streams < 1:
        raise ValueError(f"streams = {streams}: at least 1")
    run = _Run(requests, rate_scale, time_scale)
    admin_tok = token if admin_token is None else admin_token
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient(a, token=token, credentials=credentials))
            for a in addresses
        ]
        admins = [
            await stack.enter_async_context(
                AsyncClient(a, token=admin_tok, credentials=credentials)
            )
            for a in addresses
        ]
        run.tokens_by_daemon = [0] * len(addresses)
        before = await _status(admins)
        if before is None:
            print(
                "kvsched replay: these credentials may not read the daemon's status "
                "(AdminService); preemptions, KV figures and the timeline are not recorded "
                "(pass --admin-token for them)",
                file=sys.stderr,
            )
        result = ReplayResult(list(run.records.values()))
        result.daemons = await _names(admins, addresses) if before is not None else addresses
        if before is not None:
            result.unfit = unfit(requests, before)
            warn_unfit(result.unfit, before)
        # `streams` Sessions per daemon, session j on daemon j % n: request i goes to session
        # i mod len(sessions), so still to daemon i mod n. Opened before the start, so that
        # each daemon has said whether it takes batches of submits (an older daemon says it
        # with its first answer only: the start waits HEADER_WAIT_S for it at most).
        n_daemons = len(clients)
        sessions = [clients[j % n_daemons].session() for j in range(n_daemons * streams)]
        await asyncio.gather(*(s.header_read(HEADER_WAIT_S) for s in sessions))
        run.t0, result.t0_wall_ns = time.monotonic(), time.time_ns()
        sampler = (
            asyncio.ensure_future(_sample(admins, run, result, sample_every_s, progress))
            if before is not None
            else None
        )
        submitter = asyncio.ensure_future(run.submit_all(sessions))

        async def read(session: AsyncSession, daemon: int) -> None:
            async for batch in session:
                run.absorb(batch, daemon)
                if run.finished.is_set():
                    return

        readers = [asyncio.ensure_future(read(s, k % n_daemons)) for k, s in enumerate(sessions)]
        try:
            finished = asyncio.ensure_future(run.finished.wait())
            gathered = asyncio.ensure_future(asyncio.gather(*readers, return_exceptions=True))
            waits: set[asyncio.Future[Any]] = {finished, gathered}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            gathered.cancel()
            # A refused stream raises here rather than hang. The readers first: they hold the
            # daemon's status (PERMISSION_DENIED, ...), while a submit racing the refusal may
            # only have seen "RPC already finished" (InvalidStateError) writing to it.
            for r in readers:
                if r.done() and not r.cancelled():
                    r.result()
            if submitter.done():
                submitter.result()
        finally:
            for task in (sampler, submitter, *readers):
                if task is not None:
                    task.cancel()
            for session in sessions:
                session.cancel()
        after = await _status(admins) if before is not None else None
    if before is None or after is None:
        return result
    if progress:
        _progress(run, after, final=True)
    prev = {i.instance_id: i.num_preemptions for i in before.instances}
    result.preemptions = sum(
        i.num_preemptions - prev.get(i.instance_id, 0) for i in after.instances
    )
    result.instances = [
        {"instance": i.instance_id, "num_gpu_blocks": i.num_gpu_blocks}
        for i in after.instances
        if i.ready
    ]
    ready = [i for i in after.instances if i.ready]
    result.num_gpu_blocks = ready[0].num_gpu_blocks if ready else 0
    result.block_size = ready[0].block_size if ready else 0
    result.num_host_blocks = ready[0].num_host_blocks if ready else 0
    prev_host = {i.instance_id: i.prefix_cache_host_hit_tokens for i in before.instances}
    result.host_hit_tokens = sum(
        i.prefix_cache_host_hit_tokens - prev_host.get(i.instance_id, 0) for i in after.instances
    )
    prev_st = {i.instance_id: i.prefix_cache_storage_hit_tokens for i in before.instances}
    result.storage_hit_tokens = sum(
        i.prefix_cache_storage_hit_tokens - prev_st.get(i.instance_id, 0) for i in after.instances
    )
    prev_pf = {i.instance_id: i.prefix_cache_prefetched_hit_tokens for i in before.instances}
    result.prefetched_hit_tokens = sum(
        i.prefix_cache_prefetched_hit_tokens - prev_pf.get(i.instance_id, 0)
        for i in after.instances
    )
    return result


async def _statuses(admins: Sequence[AsyncClient]) -> list[apb.GetStatusResponse] | None:
    """Each daemon's status, or None when the credentials may not read it."""
    out = []
    for admin in admins:
        try:
            out.append(await admin.status(timeout=10))
        except (Unauthenticated, PermissionDenied):
            return None
    return out


async def _names(admins: Sequence[AsyncClient], addresses: list[str]) -> list[str]:
    """The daemons' cluster ids (their addresses outside a cluster)."""
    sts = await _statuses(admins)
    if sts is None:
        return addresses
    return [st.cluster.daemon_id or a for st, a in zip(sts, addresses, strict=True)]


async def _status(admins: Sequence[AsyncClient]) -> apb.GetStatusResponse | None:
    """The daemons' status, summed (instances listed once, by their owner), or None when the
    credentials may not read it."""
    sts = await _statuses(admins)
    return None if sts is None else _merge(sts)


def _merge(sts: Sequence[apb.GetStatusResponse]) -> apb.GetStatusResponse:
    out = apb.GetStatusResponse()
    seen: set[str] = set()
    for st in sts:
        out.num_running += st.num_running
        out.num_waiting += st.num_waiting
        for i in st.instances:
            if i.instance_id not in seen and (i.ready or len(sts) == 1):
                seen.add(i.instance_id)
                out.instances.append(i)
    return out


async def _sample(
    admins: Sequence[AsyncClient],
    run: _Run,
    result: ReplayResult,
    every_s: float,
    progress: bool,
) -> None:
    last_tokens, last_t = 0, run.now()
    last_by = list(run.tokens_by_daemon)
    while True:
        await asyncio.sleep(every_s / run.time_scale)
        try:
            sts = await _statuses(admins)
        except KvschedClientError:
            continue
        if sts is None:
            continue
        st = _merge(sts)
        now = run.now()
        dt = now - last_t
        rate = (run.tokens - last_tokens) / dt if dt > 0 else 0.0
        per = [
            DaemonSample(d.num_running, d.num_waiting, _usage(d), (n - m) / dt if dt > 0 else 0.0)
            for d, n, m in zip(sts, run.tokens_by_daemon, last_by, strict=True)
        ]
        last_tokens, last_t, last_by = run.tokens, now, list(run.tokens_by_daemon)
        result.timeline.append(Sample(now, st.num_running, st.num_waiting, _usage(st), rate, per))
        if progress:
            _progress(run, st)


def _usage(st: apb.GetStatusResponse) -> float:
    """Mean KV usage of the ready instances."""
    ready = [i for i in st.instances if i.ready]
    return sum(i.kv_cache_usage for i in ready) / len(ready) if ready else 0.0


def _progress(run: _Run, st: Any, final: bool = False) -> None:
    """A progress bar on a terminal; a line every 10 samples (and the last) elsewhere."""
    tty = sys.stderr.isatty()
    run.num_progress += 1
    if not (tty or final or run.num_progress % 10 == 0):
        return
    total = len(run.records)
    width = 30
    filled = int(width * run.done / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    line = (
        f"[{bar}] {run.done}/{total} done  {st.num_running} running  {st.num_waiting} waiting"
        f"  {run.tokens} tokens  t={run.now():.0f}s"
    )
    sys.stderr.write(("\r" + line + ("\n" if final else "")) if tty else line + "\n")
    sys.stderr.flush()
