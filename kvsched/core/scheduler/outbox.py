"""What the next Tasks message carries besides the step's own tasks, and its numbering: the
preempts and aborts decided since the last message (they go first: their blocks may be reused
by the tasks below them), the decode role's placements, the extensions made by report visits,
a prefix-cache reset; the seq of every message sent, the report it answers, and the round trip
measured from them, which sets the decode headroom (`threshold`).

`Outbox` is the only writer of these; `seal` completes a step's Tasks from them. Imports nothing
of the package but `events` (the counters).
"""

from __future__ import annotations

import collections
import math

from kvsched.core.config import EngineConfig
from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.protocol import Extension, Placement, StepReport, Tasks
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.events import SchedulerStats
from kvsched.core.slots import RING

# The most decode headroom (tokens) the observed round trip may ask for: within a slot's ring.
MAX_ADAPTIVE_HEADROOM = RING // 2


class Outbox:
    """Owns the pending preempts, aborts, placements, extensions and reset, the message seq,
    the round trip (`lag`) and the decode headroom it sets (`threshold`)."""

    def __init__(self, config: EngineConfig, stats: SchedulerStats) -> None:
        cc = config.cache
        self._stats = stats
        self._prealloc_threshold = cc.prealloc_threshold
        self._spec_k = config.speculative.num_speculative_tokens
        self.seq = 0  # the last Tasks message's seq (only messages sent get one)
        self.answered = -1  # the report step the last message sent answered (report_step)
        # Decode headroom follows the control plane's round trip: `lag` is how many worker
        # steps pass between the report a Tasks message was decided on and the report showing
        # the worker applied it (fast attack, slow decay); `threshold` is the room, in tokens,
        # at which a decoding request gets more blocks: prealloc_threshold, or what the worker
        # decodes in one round trip when that is more (a fast worker would otherwise pause its
        # slots waiting for extensions).
        self.lag = 0.0
        self.threshold = cc.prealloc_threshold
        self.sent: collections.deque[tuple[int, int]] = collections.deque()  # (seq, step seen)
        self.preempts: list[int] = []
        self.aborts: list[int] = []
        self.placements: list[Placement] = []
        self.extended: list[Extension] = []  # made by report visits
        self.reset = False

    # ==== what the next message carries =======================================================
    def preempt(self, handle: int) -> None:
        self.preempts.append(handle)

    def abort(self, handle: int) -> None:
        self.aborts.append(handle)

    def place(self, placement: Placement) -> None:
        self.placements.append(placement)

    def extend(self, ext: Extension) -> None:
        self.extended.append(ext)

    def reset_cache(self) -> None:
        self.reset = True

    def take_extended(self, live: dict[int, Request]) -> list[Extension]:
        """The extensions report visits made since the last step, less those whose request
        left its handle since (finished, aborted, preempted): their blocks went back with it."""
        ext = [
            e
            for e in self.extended
            if (r := live.get(e.handle)) is not None and r.status == RequestStatus.RUNNING
        ]
        self.extended = []
        return ext

    # ==== the round trip ======================================================================
    def observe_lag(self, report: StepReport) -> None:
        """The worker applied Tasks up to report.applied_seq: how many of its steps passed
        since the report that Tasks message was decided on; adapt the decode headroom."""
        sent, seen = self.sent, -1
        while sent and sent[0][0] <= report.applied_seq:
            seen = sent.popleft()[1]
        if seen < 0:
            return
        lag = float(report.step - seen)
        self.lag = lag if lag > self.lag else 0.99 * self.lag + 0.01 * lag
        want = math.ceil(self.lag * (1 + self._spec_k))
        self.threshold = max(self._prealloc_threshold, min(want, MAX_ADAPTIVE_HEADROOM))

    # ==== sealing a step's message ============================================================
    def seal(
        self,
        tasks: Tasks,
        kv: KVCacheManager,
        enc: EncoderCache | None,
        last_step: int,
        max_storage_writes: int | None = None,
    ) -> None:
        """Complete the step's Tasks: what was decided outside the step's pieces (preempts and
        aborts go first in the message), the host tier's copies, the report it answers, and a
        note for measuring the round trip (`observe_lag`). Numbers it when it is to be sent."""
        if (self.preempts or self.aborts) and (tasks.extensions or tasks.chunks):
            # A request extended or given a chunk earlier in this step may have been preempted
            # (priority preemption) or ended (a lone request out of room) later in it: drop its
            # tasks, their blocks may be reused.
            gone = {*self.preempts, *self.aborts}
            tasks.extensions = [e for e in tasks.extensions if e.handle not in gone]
            tasks.chunks = [c for c in tasks.chunks if c.handle not in gone]
        copies = kv.take_copies(self.preempts, self.aborts)
        if copies is not None:
            outs, ins = copies
            if outs:
                tasks.swap_out_gpu, tasks.swap_out_host = map(list, zip(*outs, strict=True))
            if ins:
                h_, hb_, gb_ = zip(*ins, strict=True)
                tasks.swap_in_handles, tasks.swap_in_host, tasks.swap_in_gpu = (
                    list(h_),
                    list(hb_),
                    list(gb_),
                )
        stored = kv.take_storage(self.preempts, self.aborts, max_storage_writes)
        if stored is not None:
            writes, fetches = stored
            if writes:
                tasks.storage_write_keys, tasks.storage_write_blocks = map(
                    list, zip(*writes, strict=True)
                )
            if fetches:
                f_h, f_k, f_g = zip(*fetches, strict=True)
                tasks.storage_fetch_handles = list(f_h)
                tasks.storage_fetch_keys = list(f_k)
                tasks.storage_fetch_gpu = list(f_g)
        prefetches = kv.take_prefetches()
        if prefetches is not None:
            tasks.storage_prefetch_keys, tasks.storage_prefetch_host = prefetches
        if enc is not None:
            tasks.encoder_drops = enc.take_drops()
        tasks.preempts, self.preempts = self.preempts, []
        tasks.aborts, self.aborts = self.aborts, []
        tasks.placements, self.placements = self.placements + tasks.placements, []
        tasks.reset_prefix_cache, self.reset = self.reset, False
        tasks.report_step = max(last_step, 0)
        self._stats.count_step()
        empty = tasks.is_empty()
        if empty and self.answered == last_step:
            return  # no task and no report to answer: nothing to send (seq 0)
        # Only messages sent are numbered, so a worker sees seq 1, 2, 3, ... without gaps.
        self.seq += 1
        tasks.seq = self.seq
        if tasks.swap_out_gpu or tasks.swap_in_gpu:
            kv.copies_sent(self.seq)
        if stored is not None:
            kv.storage_sent(self.seq)
        if prefetches is not None:
            kv.prefetches_sent(self.seq)
        self.answered = last_step
        if not empty:  # the report saying it was applied measures the round trip
            self.sent.append((self.seq, last_step))
            if len(self.sent) > 4096:  # a worker that never reports applying anything
                self.sent.popleft()
