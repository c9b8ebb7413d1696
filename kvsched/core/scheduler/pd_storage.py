"""Prefill/decode hand-off through the shared storage tier (`cache.pd_transfer = "storage"`):
the prefill role's side.

When a prompt's first token is reported, its full blocks are written to the storage tier (the
storage tier's own write task, GPU-sourced: it runs at the next message's boundary, before any
chunk of that message may reuse a block) and the request leaves this instance at once: its
worker handle is aborted (a handle without a KvSend would decode on), its slot and blocks are
freed. It is handed off (`Events.handed_off_stored`) once no key of its blocks is being written
any more: each is then stored (acknowledged), or its write failed. The decode instance (of this
daemon or of a peer: the store and its keys are shared) places it like a recomputed request; its
prefix lookup finds the stored run and fetches it (the storage fetch task, ordered before the
chunk that reads it), and it computes only what is not stored (the partial last block, the
first token's position; every block whose write failed). A fetch that fails preempts it and it
recomputes: nothing is lost either way.

Without a storage tier, or with a host tier (whose writes read host blocks, not these GPU
blocks), the request is handed off at once as a failed transfer: the decode side recomputes.

Imports `table`, `outbox`, `backlog` and `events` of the package; the report applier holds one.
"""

from __future__ import annotations

from dataclasses import replace

from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.protocol import SamplingParams
from kvsched.core.request import Request
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import Events
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.table import PlacementTable


class StorageHandOffs:
    """The prefill role's hand-offs whose blocks are being written to the storage tier."""

    def __init__(
        self,
        table: PlacementTable,
        kv: KVCacheManager,
        backlog: Backlog,
        outbox: Outbox,
        events: Events,
    ) -> None:
        self._table, self._kv, self._backlog = table, kv, backlog
        self._outbox, self._events = outbox, events
        self._writing: list[tuple[Request, list[str]]] = []  # in hand-off order
        self.num_handed_off = 0  # through the store (a failed write still counts)
        self.num_blocks = 0  # prompt blocks handed off through the store (written or found)

    @property
    def pending(self) -> list[Request]:
        """Requests out of the table whose writes are not all acknowledged yet."""
        return [req for req, _ in self._writing]

    @staticmethod
    def placement_sampling(req: Request) -> SamplingParams:
        """What the prefill worker is told to sample: the first token only (it then finishes
        the handle itself and decodes nothing more; min_tokens still masks a first EOS)."""
        s = req.sampling
        if s.max_tokens <= 1:
            return s
        return replace(s, max_tokens=1, min_tokens=min(s.min_tokens, 1))

    @staticmethod
    def placed_one(req: Request) -> bool:
        """The worker's LENGTH for req is its placement's max_tokens 1, not the request's."""
        return req.num_output_tokens == 1 < req.sampling.max_tokens

    def begin(self, req: Request, dropped: bool = False) -> None:
        """req's first token was reported: queue the writes of its prompt's full blocks (those
        not stored nor being written already), take it off its slot (`dropped`: its worker
        finished the handle already, else it is aborted there), and hand it off now if nothing
        of it is being written."""
        kv, st = self._kv, self._kv.storage
        n = len(req.prompt_token_ids) // kv.block_size
        keys: list[str] = []
        if st is not None and st.host_pool is None and n:
            kv.ensure_hashes(req, n)
            for block, h in zip(req.block_ids[:n], req.block_hashes[:n], strict=True):
                st.write(block, h)
                keys.append(st.key(h))
        if not dropped:
            self._outbox.abort(req.handle)
        freed = self._table.remove(req)
        self._backlog.released(req, freed)
        if not keys:  # nothing can be fetched: the decode side recomputes
            self._events.hand_off_failed.append(req)
            return
        self.num_blocks += len(keys)
        self._writing.append((req, keys))
        self.poll()

    def poll(self) -> None:
        """Hand off each request none of whose keys is being written any more (after a
        report's storage acknowledgements)."""
        if not self._writing:
            return
        st = self._kv.storage
        assert st is not None
        writing = st.index.is_writing
        still: list[tuple[Request, list[str]]] = []
        for req, keys in self._writing:
            if any(writing(k) for k in keys):
                still.append((req, keys))
            else:
                self.num_handed_off += 1
                self._events.handed_off_stored.append(req)
        self._writing = still

    def take_pending(self) -> list[Request]:
        """The instance is lost: the requests whose writes were not acknowledged (handed off
        as failed transfers by the caller: the decode side recomputes them)."""
        out = self.pending
        self._writing = []
        return out
