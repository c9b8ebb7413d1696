"""The clients: seeded requests, each a resumable stream that can go through any daemon.

Request i goes first through daemon i % 3, then (at each break) the next; every call the
daemons refuse and every token batch is written to the history. Tokens are checked later
against the sim oracle (checker.py), not here.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

from bench.chaos.history import History
from kvsched.client import AsyncClient
from kvsched.client.errors import NotFound
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable


class RecordingClient:
    """An AsyncClient whose refused calls go to the history (duck-typed for resumable())."""

    def __init__(self, address: str, index: int, history: History) -> None:
        self.client = AsyncClient(address, options=RESUMABLE_CHANNEL_OPTIONS)
        self.index = index
        self.history = history

    def _refused(self, call: str, rid: str, e: Exception) -> None:
        code = getattr(e, "code", None)
        name = getattr(code, "name", None) or type(e).__name__
        self.history.add(
            "refused", rid=rid, daemon=self.index, call=call, code=str(name), msg=str(e)[:200]
        )

    async def generate(self, prompt: Any, **kw: Any) -> Any:
        try:
            return await self.client.generate(prompt, **kw)
        except Exception as e:
            self._refused("generate", str(kw.get("request_id", "")), e)
            raise

    async def resume(self, request_id: str, tokens: Any, **kw: Any) -> Any:
        try:
            return await self.client.resume(request_id, tokens, **kw)
        except NotFound:
            raise  # "not accepted before": resumable submits it again
        except Exception as e:
            self._refused("resume", request_id, e)
            raise

    async def close(self) -> None:
        await self.client.close()


class Load:
    def __init__(
        self,
        addresses: list[str],
        history: History,
        seed: int,
        rate_per_s: float,
        max_in_flight: int,
        max_tokens: tuple[int, int] = (40, 160),
        retry_for_s: float = 600.0,
    ) -> None:
        self.history = history
        self.clients = [RecordingClient(a, k, history) for k, a in enumerate(addresses)]
        self.rng = random.Random(seed * 7919 + 1)
        self.seed = seed
        self.rate = rate_per_s
        self.max_in_flight = max_in_flight
        self.max_tokens = max_tokens
        self.retry_for_s = retry_for_s
        self.tasks: set[asyncio.Task[None]] = set()
        self.submitted = 0
        self.finished = 0
        self.lost = 0

    async def run(self, until: float) -> None:
        """Submit at `rate` (Poisson) until history time `until`, at most max_in_flight."""
        loop = asyncio.get_running_loop()
        while self.history.now() < until:
            await asyncio.sleep(self.rng.expovariate(self.rate))
            if len(self.tasks) >= self.max_in_flight:
                continue
            n = self.rng.randint(*self.max_tokens)
            prompt = [self.rng.randrange(3, 30000) for _ in range(self.rng.randint(16, 200))]
            t = loop.create_task(self._one(self.submitted, prompt, n))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)
            self.submitted += 1

    async def _one(self, i: int, prompt: list[int], n: int) -> None:
        rid = f"x{self.seed}-{i}"
        via = i % len(self.clients)
        order = self.clients[via:] + self.clients[:via]
        self.history.add("submit", rid=rid, via=via, prompt_len=len(prompt), max_tokens=n)
        s = resumable(
            cast(list[AsyncClient], order),
            prompt,
            request_id=rid,
            max_tokens=n,
            detachable=True,
            retry_for_s=self.retry_for_s,
        )
        was_accepted = False
        try:
            async for batch in s:
                if not was_accepted and s.accepted:
                    was_accepted = True
                    self.history.add("accepted", rid=rid, instance=s.instance)
                if batch:
                    self.history.add("tokens", rid=rid, toks=list(batch))
            if not was_accepted:
                self.history.add("accepted", rid=rid, instance=s.instance)
            f = s.finished
            self.history.add(
                "finish",
                rid=rid,
                reason=f.reason if f else None,
                output_tokens=f.usage.output_tokens if f else None,
                message=f.message[:300] if f else "",
                resumes=s.resumes,
            )
            self.finished += 1
        except BaseException as e:
            if s.accepted and not was_accepted:
                self.history.add("accepted", rid=rid, instance=s.instance)
            self.history.add("lost", rid=rid, error=f"{type(e).__name__}: {str(e)[:200]}")
            self.lost += 1
            if isinstance(e, asyncio.CancelledError):
                raise

    async def drain(self, timeout_s: float) -> int:
        """Wait for every request to end; cancel those still running after timeout_s (they
        are recorded as lost). Returns how many were cancelled."""
        pending = set(self.tasks)
        if not pending:
            return 0
        _, left = await asyncio.wait(pending, timeout=timeout_s)
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=10)
        return len(left)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
