"""Pick an instance for a new request: prefix overlap first, predicted queued work second.

score(i) = cached_fraction(i) - load_weight * (load(i) - min load)
    cached_fraction = prompt tokens instance i holds cached now / prompt tokens, a GPU hit
                      whole, a host-memory hit by the share of its recompute time the swap-in
                      saves (`priced_hit_tokens`, the instance's step-cost model)
    load            = predicted queued prefill seconds / load_seconds  +  KV usage

Placement is judged by goodput (issue 25; docs/BENCHMARKS.md section 13): only the instances whose
predicted wait for the request (`predicted_wait_ms`, times a factor calibrated against the
measured TTFT of the requests placed, `WaitCalibration`) meets its deadline (its own, or
`ttft_target_ms`) are scored. When none is, the request overflows: demoted (queued behind
every request that can still make its deadline) on the instance predicted to reach it first,
or refused with a retry hint. Below capacity every instance qualifies and this is the score
rule alone; past it, equal queues that all miss the target no longer take every request.

The queued prefill is each instance's own prediction (`Scheduler.predicted_backlog_ms`: the
step-cost model's prefill terms over the uncached tokens of the prompts waiting or being
prefilled there, at the share of a step its decodes leave to prefill), so one 85k-token prompt
weighs what it costs, not what one short request does. A request follows its cached prefix
unless that instance is clearly busier than the least-loaded one; with nothing cached anywhere
it goes to the instance with the least predicted work.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvsched.core.config import Role
from kvsched.core.errors import CapacityExceeded, Unavailable
from kvsched.core.request import Request
from kvsched.core.scheduler import Scheduler

OVERLOAD_POLICIES = ("demote", "refuse", "off")


def predicted_wait_ms(s: Scheduler, req: Request, hit_tokens: int) -> float:
    """Predicted ms from now to req's first token if `s` queued it now with hit_tokens cached:
    the prefill queued ahead of it in its class (and admitted prompts not yet sent) plus its
    own, at the share of each step the decodes leave to prefill (the instance's own rule,
    `predicted_wait_ms`)."""
    own, req.queued_ms = req.queued_ms, s.predicted_prefill_ms(req, hit_tokens)
    try:
        return s.predicted_wait_ms(req)
    finally:
        req.queued_ms = own


class WaitCalibration:
    """Measured TTFT over predicted wait, learned from the requests the router placed: the
    factor the router multiplies its predictions by (1.0 until a first token is measured).
    Pure: reads each request's arrival_time and first_token_time (the scheduler's clock)."""

    def __init__(self, alpha: float = 0.05, check_per_pick: int = 4, keep: int = 4096) -> None:
        self.factor = 1.0
        self.alpha = alpha
        self.check_per_pick = check_per_pick
        self._placed: collections.deque[tuple[Request, float]] = collections.deque(maxlen=keep)
        self.num_measured = 0

    def placed(self, req: Request, predicted_ms: float) -> None:
        self._placed.append((req, predicted_ms / max(self.factor, 1e-9)))

    def update(self) -> None:
        """Look at a few placed requests (round robin): fold the ratio of those with a first
        token, drop finished ones, keep the rest."""
        q = self._placed
        for _ in range(min(self.check_per_pick, len(q))):
            req, predicted = q.popleft()
            if req.first_token_time >= 0:
                if predicted >= 50.0 and not req.demoted:  # tiny predictions are all noise
                    measured = 1e3 * (req.first_token_time - req.arrival_time)
                    ratio = min(4.0, max(0.25, measured / predicted))
                    self.factor += self.alpha * (ratio - self.factor)
                    self.num_measured += 1
            elif req.finished_time < 0:
                q.append((req, predicted))


def priced_hit_tokens(
    gpu_tokens: float,
    runs: Sequence[tuple[float, float]],
    prefill_token_ms: float,
    attention_ms: float,
) -> float:
    """Prompt tokens a hit is worth: GPU hits whole; each further run (tokens, ms to bring them
    to the GPU) in tier order (host memory: swap-in, then storage: fetch by size / bandwidth)
    by the share of its recompute time the transfer saves (none when moving costs more than
    recomputing: the step-cost model's prefill terms over its positions)."""
    worth, start = float(gpu_tokens), float(gpu_tokens)
    for tokens, transfer_ms in runs:
        if tokens <= 0:
            continue
        end = start + tokens
        recompute = prefill_token_ms * tokens + attention_ms * (end * end - start * start) / 2
        if recompute > 0:
            worth += tokens * max(0.0, 1.0 - transfer_ms / recompute)
        start = end
    return worth


def tier_hit_tokens(s: Scheduler, req: Request) -> tuple[int, int]:
    """(GPU, host) prompt tokens of req's longest cached run on `s` (prefix_hit_tokens split by
    tier: the GPU prefix, then its continuation in host memory)."""
    kv = s.kv
    if not kv.enable_caching:
        return 0, 0
    kv.ensure_hashes(req, (req.num_tokens - 1) // s.block_size)
    lookup, n = kv.pool.cached.get, 0
    for h in req.block_hashes:
        if lookup(h) is None:
            break
        n += 1
    host = len(kv.host.run_from(req.block_hashes[n:])) if kv.host is not None else 0
    return n * s.block_size, host * s.block_size


def priced_hit(s: Scheduler, req: Request) -> tuple[float, int]:
    """(tokens the hit is worth on `s`, tokens cached in either tier)."""
    gpu, host = tier_hit_tokens(s, req)
    if not host:
        return float(gpu), gpu
    a_tok, a_attn = s.cost.prefill_costs
    swap_ms = s.cost.swap_block_ms * host / s.block_size
    return priced_hit_tokens(gpu, [(host, swap_ms)], a_tok, a_attn), gpu + host


def load_value(running: float, waiting: float, max_num_seqs: float, kv_usage: float) -> float:
    """An instance's load from its numbers (as `Router.load` reads them off a scheduler)."""
    return (running + waiting) / max(1.0, max_num_seqs) + kv_usage


def backlog_load(backlog_ms: float, kv_usage: float, load_seconds: float) -> float:
    """An instance's load from its predicted queued prefill and KV usage (`Router.load`'s
    rule over numbers, for a peer's instance known from what it published)."""
    return backlog_ms / (1e3 * load_seconds) + kv_usage


def best_by_score(hits: Sequence[float], loads: Sequence[float], load_weight: float) -> int:
    """Index maximising hit - load_weight * (load - min load): the rule of `Router.pick`, for
    candidates known only by numbers (a cluster's instances on other daemons). First wins ties."""
    base = min(loads)
    best, best_score = 0, float("-inf")
    for i, (hit, load) in enumerate(zip(hits, loads, strict=True)):
        score = hit - load_weight * (load - base)
        if score > best_score:
            best, best_score = i, score
    return best


class Router:
    def __init__(
        self,
        load_weight: float = 0.5,
        load_seconds: float = 3.0,
        ttft_target_ms: float = 5000.0,
        overload: str = "demote",
    ) -> None:
        """load_seconds: the predicted queued prefill that weighs as much as a full KV pool.
        ttft_target_ms: the wait a request without a deadline of its own is placed to meet.
        overload: what happens to a request no instance is predicted to serve in time:
        "demote" (placed behind every request that can still make its deadline, on the
        instance that will reach it first), "refuse" (CapacityExceeded with a retry hint) or
        "off" (placed by score alone, as before issue 25)."""
        if overload not in OVERLOAD_POLICIES:
            raise ValueError(f"overload = {overload!r}; expected one of {OVERLOAD_POLICIES}")
        self.load_weight = load_weight
        self.load_seconds = load_seconds
        self.ttft_target_ms = ttft_target_ms
        self.overload = overload
        self.calibration = WaitCalibration()
        self.num_overflowed = 0  # requests no instance was predicted to serve in time

    def load(self, s: Scheduler) -> float:
        return backlog_load(s.predicted_backlog_ms(), s.kv.usage, self.load_seconds)

    @staticmethod
    def count_load(s: Scheduler) -> float:
        """Requests placed or queued per slot, plus KV usage (decode instances)."""
        return load_value(s.num_running, s.num_waiting, s.config.scheduler.max_num_seqs, s.kv.usage)

    def pick(self, schedulers: Sequence[Scheduler], req: Request) -> int:
        """Index of the instance that should take `req` (a new request: never a decode-role
        instance). A paused instance queues what it is given, so it is chosen only when every
        candidate is paused (the request waits for Resume there). Raises Unavailable when no
        instance can take new requests, CapacityExceeded when the overload policy is
        "refuse" and no instance is predicted to meet the request's deadline."""
        cands = [i for i, s in enumerate(schedulers) if s.config.role != Role.DECODE]
        cands = [i for i in cands if not schedulers[i].paused] or cands
        if not cands:
            raise Unavailable("no instance is ready to take new requests")
        if len(cands) == 1 and self.overload == "off":
            return cands[0]
        self.calibration.update()
        n = max(1, len(req.prompt_token_ids))
        # Block hashes depend on the block size: with mixed sizes, rehash per instance.
        mixed = len({schedulers[i].block_size for i in cands}) > 1
        hits: dict[int, float] = {}
        waits: dict[int, float] = {}
        for i in cands:
            if mixed:
                req.block_hashes = []
            s = schedulers[i]
            worth, hit = priced_hit(s, req)
            hits[i] = worth / n
            waits[i] = self.calibration.factor * predicted_wait_ms(s, req, hit)
        if mixed:
            req.block_hashes = []
        target = req.ttft_deadline_ms or self.ttft_target_ms
        ok = [i for i in cands if waits[i] <= target]
        if self.overload == "off" or ok:
            pool = cands if self.overload == "off" else ok
            loads = {i: self.load(schedulers[i]) for i in pool}
            best = pool[
                best_by_score([hits[i] for i in pool], [loads[i] for i in pool], self.load_weight)
            ]
        else:
            self.num_overflowed += 1
            best = min(cands, key=lambda i: waits[i])
            if self.overload == "refuse":
                raise CapacityExceeded(
                    f"request {req.req_id!r}: every instance is predicted to reach its first "
                    f"token after {target:,.0f} ms (the soonest in {waits[best]:,.0f} ms); "
                    f"retry in {max(1.0, (waits[best] - target) / 1e3):.0f} s or elsewhere"
                )
            req.demoted = True
        self.calibration.placed(req, waits[best])
        return best

    def pick_decode(self, schedulers: Sequence[Scheduler]) -> int | None:
        """Least-loaded decode-role instance (by requests per slot and KV usage: a decode
        instance queues no prefill), or None when there is none."""
        cands = [
            i for i, s in enumerate(schedulers) if s.config.role == Role.DECODE and not s.paused
        ]
        return min(cands, key=lambda i: self.count_load(schedulers[i])) if cands else None
