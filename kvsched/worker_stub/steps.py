"""The worker's step loop: at each step boundary apply everything received, step the engine,
push due KV, report; pace reports by the daemon's answers.

Everything that touches the engine runs here (or in the thread a model step runs in, while the
loop awaits it), so the engine needs no lock. The loop never awaits the daemon while it has
runnable work: reports go into the session's outbox, which gRPC drains.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable

from kvsched import codec
from kvsched.core.errors import ProtocolError
from kvsched.core.protocol import KvSend, StepReport, Tasks
from kvsched.v1 import worker_service_pb2 as pb
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.factories import EngineFactory, EngineSettings
from kvsched.worker_stub.kv_push import KvPush, ReceivedPush
from kvsched.worker_stub.stats import WorkerStats
from kvsched.worker_stub.storage_kv import StoreLink

log = logging.getLogger(__name__)

_MAX_OVERSLEEP_CREDIT_S = 0.002
# Reports sent and not yet answered by a Tasks message (its report_step) before later steps'
# reports are held and merged: two in flight, as the daemon's own pipelining assumes (it
# schedules one step ahead; see the WorkerService comment in worker_service.proto).
MAX_UNANSWERED = 2

InboxItem = Tasks | pb.Welcome | ReceivedPush
Outbox = asyncio.Queue[pb.ConnectRequest | None]


class StepLoop:
    """The engine of one worker rank and the loop that steps it, over all its sessions (the
    engine is kept, and reset, while the daemon's settings stay the same). The session
    subclasses it and supplies `_send`."""

    def __init__(
        self,
        engine_factory: EngineFactory,
        kv: KvPush,
        stats: WorkerStats,
        *,
        rank: int,
        block_size: int,
        on_step: Callable[[StepReport], None] | None,
    ) -> None:
        self._factory = engine_factory
        self.kv = kv
        self.stats = stats
        self.rank = rank
        self.block_size = block_size
        self.max_loras = 0  # the adapter slots announced (Worker sets it; 0: none)
        self._on_step = on_step
        self.engine: WorkerEngine | None = None
        self._settings: EngineSettings | None = None
        self._max_placed = 0  # highest handle placed this session
        self._oversleep_s = 0.0
        # Report pacing: steps of the reports sent and not yet answered (Tasks.report_step),
        # and the merged report of later steps held back meanwhile.
        self._unanswered: collections.deque[int] = collections.deque()
        self._held: pb.ConnectRequest | None = None
        self._paced = False  # this session's daemon answers reports (Welcome.answers_reports)
        self._deferred: collections.deque[Tasks] = collections.deque()  # ranks > 0, see below
        self.store_link = StoreLink()  # the storage tier (step 13), kept across sessions
        # Tasks with store I/O are applied here, one at a time; the last one is awaited before
        # a new session resets the engine (a broken stream does not stop a running apply).
        self._io_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._io: concurrent.futures.Future[None] | None = None

    def _send(self, outbox: Outbox, msg: pb.ConnectRequest) -> None:
        raise NotImplementedError  # the session's: it times heartbeats by what it sent

    def _new_session(self) -> None:
        """Forget the pacing and deferred Tasks of the stream that ended."""
        self._unanswered.clear()
        self._held = None
        self._deferred.clear()

    async def _welcome(self, inbox: asyncio.Queue[InboxItem]) -> pb.Welcome:
        while True:
            item = await inbox.get()
            if isinstance(item, pb.Welcome):
                return item
            if isinstance(item, ReceivedPush):  # resolved once the engine runs
                self.kv.pending.append(item)
                continue
            raise ProtocolError(f"the daemon sent {type(item).__name__} before welcome")

    def _start_engine(self, welcome: pb.Welcome) -> WorkerEngine:
        """The engine for this session, empty: reset when the settings are unchanged."""
        settings = EngineSettings(
            block_size=welcome.block_size or self.block_size,
            num_speculative_tokens=welcome.num_speculative_tokens,
            max_model_len=welcome.max_model_len,
        )
        if self.engine is not None and settings == self._settings:
            self.engine.reset()
        else:
            self.engine = self._factory(settings, self._queue_kv_push)
        self._settings = settings
        self._paced = welcome.answers_reports
        self._max_placed = 0
        return self.engine

    async def _use_storage(self, engine: WorkerEngine, url: str, key_suffix: str) -> None:
        """Connect to the store the Welcome names (off the loop: it may take seconds); the sim
        only prices storage transfers and connects to nothing."""
        engine.storage.key_suffix = key_suffix
        if not engine.storage.simulated:
            engine.storage.link = self.store_link
            await asyncio.to_thread(self.store_link.use, url)

    def _queue_kv_push(self, send: KvSend, data: bytes) -> None:
        assert self.engine is not None
        self.kv.queue(self.engine, send, data)

    async def _step_loop(
        self, engine: WorkerEngine, inbox: asyncio.Queue[InboxItem], outbox: Outbox
    ) -> None:
        kv = self.kv
        while True:
            while not inbox.empty():
                await self._take(engine, inbox.get_nowait(), outbox)
            kv.resolve(engine, self._max_placed)
            if engine.has_runnable():
                await self._step(engine, outbox)
                self._apply_deferred(engine)
                continue
            if self._deferred:  # nothing left to step towards: apply (a conflict raises)
                self._apply_deferred(engine, force=True)
                continue
            waiting_on_daemon = engine.num_held > 0
            started = time.perf_counter()
            item = await inbox.get()
            idle = time.perf_counter() - started
            self.stats.idle_s += idle
            if waiting_on_daemon:
                self.stats.idle_waiting_on_daemon_s += idle
            await self._take(engine, item, outbox)

    def _apply_deferred(self, engine: WorkerEngine, force: bool = False) -> None:
        """Ranks > 0 step on their own, not in lockstep with rank 0 as real TP ranks are: one
        that lags may get a placement on a slot whose occupant rank 0 has already finished.
        Such Tasks wait (in order) until this rank's own steps free the slot."""
        deferred = self._deferred
        while deferred and (force or engine.slots_free_for(deferred[0])):
            engine.apply(deferred.popleft())
            force = False

    async def _take(self, engine: WorkerEngine, item: InboxItem, outbox: Outbox) -> None:
        """Accept an item; Tasks whose storage tasks do store I/O are applied in a thread
        (a store that is down answers in seconds) while the loop keeps heartbeating."""
        applied = isinstance(item, Tasks) and self.rank == 0 and engine.storage.blocking(item)
        if applied:
            if self._io_pool is None:
                self._io_pool = concurrent.futures.ThreadPoolExecutor(1, "kvsched-storage")
            self._io = self._io_pool.submit(engine.apply, item)  # type: ignore[arg-type]
            await asyncio.wrap_future(self._io)
        self._accept(engine, item, outbox, applied)

    async def _settle_io(self) -> None:
        """Wait for an apply the last session left running in the storage thread."""
        io, self._io = self._io, None
        if io is not None and not io.done():
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(io)

    def _close_io(self) -> None:
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=False)
            self._io_pool = None

    async def _leave_storage(self) -> None:
        """The worker leaves: let a storage apply still running finish (bounded by the store
        client's timeouts), then close the store's client. Its close holds the GIL (~1 s with
        the master up): done here, once, rather than by the garbage collector's finalizer at
        any later moment of a process that goes on (a worker run in-process, by tests)."""
        await self._settle_io()
        self._close_io()
        await asyncio.to_thread(self.store_link.use, "")

    def _accept(
        self, engine: WorkerEngine, item: InboxItem, outbox: Outbox, applied: bool = False
    ) -> None:
        if isinstance(item, Tasks):
            if self.rank == 0:
                if not applied:
                    engine.apply(item)
                self._answered(outbox, item.report_step)
            else:
                self._deferred.append(item)
                self._apply_deferred(engine)
            for p in item.placements:
                self._max_placed = max(self._max_placed, p.handle)
        elif isinstance(item, ReceivedPush):
            self.kv.pending.append(item)
        else:
            log.warning("ignoring a second welcome on one stream")

    async def _step(self, engine: WorkerEngine, outbox: Outbox) -> None:
        started = time.perf_counter()
        if engine.executor.name == "sim":
            report = engine.step()
            await self._simulate_gpu(started, report.step_time_ns / 1e9 if report else 0.0)
        else:  # real compute: keep the loop free to receive tasks and pushes meanwhile
            report = await asyncio.to_thread(engine.step)
        kv = self.kv
        due, kv.due = kv.due, []
        if due:
            await kv.push_all(due, report)
        self.stats.num_steps += 1
        self.stats.busy_s += time.perf_counter() - started
        if report is None:
            return
        if engine.step_loras:
            self.stats.lora_step(engine.step_loras, self.max_loras)
            if self.max_loras and engine.step_loras > self.max_loras:
                log.error(
                    "step %d ran %d LoRA adapters, over max_loras %d",
                    report.step,
                    engine.step_loras,
                    self.max_loras,
                )
        self.stats.num_tokens += sum(report.num_new_tokens)
        self.stats.num_draft_tokens += engine.num_draft_tokens
        self.stats.num_accepted_drafts += engine.num_accepted_drafts
        engine.num_draft_tokens = engine.num_accepted_drafts = 0
        self.stats.kv_export_s += engine.kv_export_s
        engine.kv_export_s = 0.0
        st = engine.storage
        if st.write_s or st.fetch_s:
            self.stats.storage_write_s += st.write_s
            self.stats.storage_fetch_s += st.fetch_s
            st.write_s = st.fetch_s = 0.0
        self.stats.num_prefill_tokens += engine.num_prefill_tokens
        engine.num_prefill_tokens = 0
        self.stats.num_rows_ahead += engine.num_rows_ahead
        self.stats.num_rows_deferred += engine.num_rows_deferred
        self.stats.num_rows_wasted += engine.num_rows_wasted
        engine.num_rows_ahead = engine.num_rows_deferred = engine.num_rows_wasted = 0
        self.stats.num_paused += len(report.paused)
        if self.rank == 0:
            self._report(outbox, codec.report_message(report))
        if self._on_step is not None:
            self._on_step(report)

    def _report(self, outbox: Outbox, msg: pb.ConnectRequest) -> None:
        """Send a step's report, or hold it while MAX_UNANSWERED reports wait for the daemon's
        answer: held reports merge into one (columns appended, the later step), sent as soon as
        an answer comes. A daemon that falls behind then gets fewer, larger reports instead of
        a growing queue of stale ones, and its decisions stay within a few steps of the worker.
        """
        if self._held is not None:
            codec.merge_reports(self._held.report, msg.report)
        elif self._paced and len(self._unanswered) >= MAX_UNANSWERED:
            self._held = msg
        else:
            self._send(outbox, msg)
            if self._paced:
                self._unanswered.append(msg.report.step)
            self.stats.num_reports += 1

    def _answered(self, outbox: Outbox, report_step: int) -> None:
        """A Tasks message says the daemon applied reports up to report_step."""
        unanswered = self._unanswered
        while unanswered and unanswered[0] <= report_step:
            unanswered.popleft()
        if self._held is not None and len(unanswered) < MAX_UNANSWERED:
            msg, self._held = self._held, None
            self._send(outbox, msg)
            unanswered.append(msg.report.step)  # merged: the latest step
            self.stats.num_reports += 1

    async def _simulate_gpu(self, started: float, step_time_s: float) -> None:
        """Sleep out the simulated step. asyncio wakes up to ~1 ms late (epoll rounds its
        timeout up to whole ms); the next step sleeps that much less so steps average right."""
        if step_time_s <= 0:
            await asyncio.sleep(0)  # zero-cost: only yield to the reader and heartbeats
            return
        target = started + step_time_s - self._oversleep_s
        await asyncio.sleep(max(0.0, target - time.perf_counter()))
        late = time.perf_counter() - target
        self._oversleep_s = min(max(late, 0.0), _MAX_OVERSLEEP_CREDIT_S)
