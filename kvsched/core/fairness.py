"""Fair shares between tenants and the `slo` waiting queue (scheduling rule 12 in
docs/ARCHITECTURE.md).

Virtual token counters, as VTC (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024): each tenant has a counter of the tokens the instance served it, divided by its
weight (prompt tokens as they are handed to the worker, output tokens as they are reported,
times `output_token_weight`). Among the tenants with requests waiting in the best priority
class, the one with the smallest counter is admitted next, so while tenants are backlogged
their served tokens follow their weights. A tenant whose queue was empty is lifted, when a
request of it arrives, to the smallest counter among the backlogged tenants (or to the counter
of the last tenant admitted, when none is): idle time earns no credit to spend later.

The `slo` queue orders: priority class (lower first; a demoted request after every request
that is not), then tenant (smallest counter), then earliest TTFT deadline, then arrival. A
preempted request re-enters at the front of its class and tenant. Removal of an aborted
request is lazy, as in `queue.py`. A peek costs O(classes + tenants waiting), not O(requests).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from kvsched.core.config import FairnessConfig, QueuePolicy
from kvsched.core.queue import RequestQueue
from kvsched.core.queue import make_queue as make_basic_queue
from kvsched.core.request import Request, RequestStatus

ClassKey = tuple[bool, int]  # (demoted, priority): smaller runs first


def class_key(req: Request) -> ClassKey:
    return (req.demoted, req.priority)


class TenantCounters:
    """Virtual token counters per tenant (weighted served tokens)."""

    def __init__(self, config: FairnessConfig) -> None:
        self.config = config
        self.counters: dict[str, float] = {}
        self.served: dict[str, int] = {}  # tokens served, unweighted (prompt + output)
        self.shed: dict[str, int] = {}  # requests shed (or demoted) per tenant
        self.floor = 0.0  # the counter of the tenant admitted last

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int = 0) -> None:
        cfg = self.config
        cost = prompt_tokens + output_tokens * cfg.output_token_weight
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / cfg.weight(tenant)
        self.served[tenant] = self.served.get(tenant, 0) + prompt_tokens + output_tokens

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def lift(self, tenant: str, backlogged: Iterator[str]) -> None:
        """`tenant` has just become backlogged: no credit for the time it was idle."""
        others = [self.counters.get(t, 0.0) for t in backlogged if t != tenant]
        low = min(others) if others else self.floor
        if self.counters.get(tenant, 0.0) < low:
            self.counters[tenant] = low


class SloQueue(RequestQueue):
    """Priority class, then tenant by virtual counter, then earliest deadline."""

    def __init__(self, counters: TenantCounters) -> None:
        super().__init__()
        self.counters = counters
        # class -> tenant -> heap of (front? 0 : 1, deadline, seq, request)
        self._q: dict[ClassKey, dict[str, list[tuple[int, float, int, Request]]]] = {}
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)
        self._waiting_by_tenant: dict[str, int] = {}
        self._ms_by_class: dict[ClassKey, float] = {}

    # ---- accounting -------------------------------------------------------------------------
    def _enter(self, req: Request) -> None:
        t = req.tenant
        n = self._waiting_by_tenant.get(t, 0)
        if n == 0:
            self.counters.lift(t, iter(self._waiting_by_tenant))
        self._waiting_by_tenant[t] = n + 1
        self._live += 1
        self._count_lora(req, 1)
        self.queued_ms += req.queued_ms
        k = class_key(req)
        self._ms_by_class[k] = self._ms_by_class.get(k, 0.0) + req.queued_ms

    def _leave(self, req: Request) -> None:
        t = req.tenant
        n = self._waiting_by_tenant[t] - 1
        if n:
            self._waiting_by_tenant[t] = n
        else:
            del self._waiting_by_tenant[t]
        self._live -= 1
        self._count_lora(req, -1)
        k = class_key(req)
        left = self._ms_by_class.get(k, 0.0) - req.queued_ms
        self._ms_by_class[k] = max(0.0, left)
        self.queued_ms = max(0.0, self.queued_ms - req.queued_ms) if self._live else 0.0

    def discard(self, req: Request) -> None:
        self._leave(req)

    def ms_ahead(self, req: Request) -> float:
        """Predicted prefill milliseconds queued in req's priority class and the better ones."""
        k = class_key(req)
        return sum(ms for c, ms in self._ms_by_class.items() if c <= k)

    # ---- the queue --------------------------------------------------------------------------
    def push(self, req: Request) -> None:
        self._push(req, (1, req.deadline, next(self._seq), req))

    def push_front(self, req: Request) -> None:
        self._push(req, (0, req.deadline, next(self._front_seq), req))

    def _push(self, req: Request, entry: tuple[int, float, int, Request]) -> None:
        self._enter(req)
        tenants = self._q.setdefault(class_key(req), {})
        heapq.heappush(tenants.setdefault(req.tenant, []), entry)

    def _head(self) -> tuple[list[tuple[int, float, int, Request]], Request] | None:
        for k in sorted(self._q):
            tenants = self._q[k]
            best: tuple[list[tuple[int, float, int, Request]], Request] | None = None
            best_c = 0.0
            for t in list(tenants):
                h = tenants[t]
                while h and h[0][3].status != RequestStatus.WAITING:
                    heapq.heappop(h)
                if not h:
                    del tenants[t]
                    continue
                c = self.counters.counter(t)
                if best is None or c < best_c:
                    best, best_c = (h, h[0][3]), c
            if best is not None:
                return best
            del self._q[k]
        return None

    def peek(self) -> Request | None:
        head = self._head()
        return None if head is None else head[1]

    def pop(self) -> Request:
        head = self._head()
        assert head is not None
        h, req = head
        heapq.heappop(h)
        self._leave(req)
        self.counters.floor = self.counters.counter(req.tenant)
        return req

    def __iter__(self) -> Iterator[Request]:
        entries = [e for tenants in self._q.values() for h in tenants.values() for e in h]
        entries.sort(key=lambda e: (class_key(e[3]), e[:3]))
        return (e[3] for e in entries if e[3].status == RequestStatus.WAITING)


def make_queue(policy: str, counters: TenantCounters) -> RequestQueue:
    return SloQueue(counters) if policy == QueuePolicy.SLO else make_basic_queue(policy)
