"""Waiting queues. Removal of an aborted waiting request is lazy (it is skipped when it reaches
the head), so abort is O(1) and no `list.remove` or `x in deque` ever runs."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from kvsched.core.request import Request, RequestStatus


class RequestQueue:
    """Base: `push`, `push_front` (a preempted request goes back first), `peek`, `pop`, `len`."""

    def __init__(self) -> None:
        self._live = 0
        # Predicted prefill milliseconds of the queued requests (their `queued_ms`), for
        # shedding and routing by queued work.
        self.queued_ms = 0.0
        # LoRA adapter -> queued requests naming it (vLLM's waiting_lora_adapters; routing).
        self.loras: dict[str, int] = {}

    def __len__(self) -> int:
        return self._live

    def _count(self, req: Request, sign: int) -> None:
        self._live += sign
        self.queued_ms = max(0.0, self.queued_ms + sign * req.queued_ms) if self._live else 0.0
        self._count_lora(req, sign)

    def _count_lora(self, req: Request, sign: int) -> None:
        name = req.lora_name
        if name:
            n = self.loras.get(name, 0) + sign
            if n > 0:
                self.loras[name] = n
            else:
                self.loras.pop(name, None)

    def discard(self, req: Request) -> None:
        """Account for a request that left while queued (abort); it is skipped lazily."""
        self._count(req, -1)

    def ms_ahead(self, req: Request) -> float:
        """Predicted prefill milliseconds queued ahead of a new request like req (all of it)."""
        return self.queued_ms

    def peek(self) -> Request | None:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def push(self, req: Request) -> None:
        raise NotImplementedError

    def push_front(self, req: Request) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError


def _queued(req: Request) -> bool:
    return req.status == RequestStatus.WAITING


class FcfsQueue(RequestQueue):
    def __init__(self) -> None:
        super().__init__()
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)
        self._count(req, 1)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)
        self._count(req, 1)

    def peek(self) -> Request | None:
        q = self._q
        while q and not _queued(q[0]):
            q.popleft()
        return q[0] if q else None

    def pop(self) -> Request:
        req = self.peek()
        assert req is not None
        self._q.popleft()
        self._count(req, -1)
        return req

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._q if _queued(r))


class PriorityQueue(RequestQueue):
    """Lower priority value first, then earlier arrival, then insertion order. A preempted
    request re-enters by its own key, which puts it ahead of later arrivals of its priority."""

    def __init__(self) -> None:
        super().__init__()
        self._h: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, req: Request) -> None:
        heapq.heappush(self._h, (req.priority, req.arrival_time, next(self._seq), req))
        self._count(req, 1)

    push_front = push

    def peek(self) -> Request | None:
        h = self._h
        while h and not _queued(h[0][3]):
            heapq.heappop(h)
        return h[0][3] if h else None

    def pop(self) -> Request:
        req = self.peek()
        assert req is not None
        heapq.heappop(self._h)
        self._count(req, -1)
        return req

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._h) if _queued(e[3]))


def make_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
