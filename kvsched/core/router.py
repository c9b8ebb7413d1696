"""Pick an instance for a new request: prefix overlap first, predicted queued work second.

score(i) = cached_fraction(i) - load_weight * (load(i) - min load)
    cached_fraction = prompt tokens instance i holds cached now / prompt tokens
    load            = predicted queued prefill seconds / load_seconds  +  KV usage

The queued prefill is each instance's own prediction (`Scheduler.predicted_backlog_ms`: the
step-cost model's prefill terms over the uncached tokens of the prompts waiting or being
prefilled there, at the share of a step its decodes leave to prefill), so one 85k-token prompt
weighs what it costs, not what one short request does. A request follows its cached prefix
unless that instance is clearly busier than the least-loaded one; with nothing cached anywhere
it goes to the instance with the least predicted work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvsched.core.errors import Unavailable
from kvsched.core.request import Request


class Candidate(Protocol):
    """What the router reads of an instance: a Scheduler, or the daemon's engine of one (which
    publishes these facts and nothing else of its scheduler)."""

    @property
    def paused(self) -> bool: ...

    @property
    def is_decode(self) -> bool: ...

    @property
    def block_size(self) -> int: ...

    def prefix_hit_tokens(self, req: Request) -> int: ...

    def load_facts(self) -> dict[str, float]: ...


def instance_load(facts: Mapping[str, float], load_seconds: float, by_count: bool = False) -> float:
    """An instance's load, from its facts (`Scheduler.load_facts`, or what a peer published):
    predicted queued prefill seconds / load_seconds + KV usage; or, by requests placed or
    queued per slot + KV usage when `by_count` (a decode instance queues no prefill) or when the
    facts carry no prediction (a peer that publishes only counts). The only load formula."""
    kv_usage = facts.get("kv_usage", 0.0)
    if not by_count and "predicted_backlog_ms" in facts:
        return facts["predicted_backlog_ms"] / (1e3 * load_seconds) + kv_usage
    n = facts.get("running", 0.0) + facts.get("waiting", 0.0)
    return n / max(1.0, facts.get("max_num_seqs", 1.0)) + kv_usage


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
    def __init__(self, load_weight: float = 0.5, load_seconds: float = 3.0) -> None:
        """load_seconds: the predicted queued prefill that weighs as much as a full KV pool."""
        self.load_weight = load_weight
        self.load_seconds = load_seconds

    def load(self, s: Candidate) -> float:
        return instance_load(s.load_facts(), self.load_seconds)

    @staticmethod
    def count_load(s: Candidate) -> float:
        """Requests placed or queued per slot, plus KV usage (decode instances)."""
        return instance_load(s.load_facts(), 1.0, by_count=True)

    def pick(self, schedulers: Sequence[Candidate], req: Request) -> int:
        """Index of the instance that should take `req` (a new request: never a decode-role
        instance). A paused instance queues what it is given, so it is chosen only when every
        candidate is paused (the request waits for Resume there). Raises Unavailable when no
        instance can take new requests."""
        cands = [i for i, s in enumerate(schedulers) if not s.is_decode]
        cands = [i for i in cands if not schedulers[i].paused] or cands
        if not cands:
            raise Unavailable("no instance is ready to take new requests")
        if len(cands) == 1:
            return cands[0]
        loads = {i: self.load(schedulers[i]) for i in cands}
        base = min(loads.values())
        n = max(1, len(req.prompt_token_ids))
        # Block hashes depend on the block size: with mixed sizes, rehash per instance.
        mixed = len({schedulers[i].block_size for i in cands}) > 1
        best, best_score = cands[0], float("-inf")
        for i in cands:
            if mixed:
                req.block_hashes = []
            hit = schedulers[i].prefix_hit_tokens(req) / n
            score = hit - self.load_weight * (loads[i] - base)
            if score > best_score:
                best, best_score = i, score
        if mixed:
            req.block_hashes = []
        return best

    def pick_decode(self, schedulers: Sequence[Candidate]) -> int | None:
        """Least-loaded decode-role instance (by requests per slot and KV usage: a decode
        instance queues no prefill), or None when there is none."""
        cands = [i for i, s in enumerate(schedulers) if s.is_decode and not s.paused]
        return min(cands, key=lambda i: self.count_load(schedulers[i])) if cands else None
