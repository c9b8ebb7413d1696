"""Pick an instance for a new request: prefix overlap first, predicted queued work second.

`choose` is the rule over plain candidates (numbers: hit fraction, predicted wait, load) and
returns a `Choice`; `Router.pick` computes those numbers for this daemon's instances, the
cluster's router for its own and its peers' instances; the callers send the request. Each
instance's load is one value its owner produces with `instance_load` (the daemon's engines,
`InstanceEngine.load`, published to peers); the router is handed those values.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

import kvsched.core.lifecycle as lifecycle
from kvsched.core.block_hash import use_hashes
from kvsched.core.errors import CapacityExceeded, Unavailable
from kvsched.core.request import Request

OVERLOAD_POLICIES = ("demote", "refuse", "off")
# The predicted queued prefill that weighs as much as a full KV pool (`instance_load`): the
# router's default, and the weight of a peer's facts that carry no load value of their own.
LOAD_SECONDS = 3.0


def predicted_wait_ms(s: Candidate, req: Request, hit_tokens: int) -> float:
    """Predicted ms from now to req's first token if `s` queued it now with hit_tokens cached:
    the prefill queued ahead of it in its class (and admitted prompts not yet sent) plus its
    own, at the share of each step the decodes leave to prefill (the instance's own rule,
    `Scheduler.predicted_wait_ms`)."""
    return s.predicted_wait_ms(req, hit_tokens)


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


def priced_hit(s: Candidate, req: Request) -> tuple[float, int]:
    """(tokens the hit is worth on `s`, tokens cached in either tier): GPU hits whole, host
    hits by the share of their recompute time a swap-in saves (`priced_hit_tokens`)."""
    return s.priced_hit(req)


class Candidate(Protocol):
    """What the router reads of an instance: a Scheduler, or the daemon's engine of one (which
    publishes these facts and nothing else of its scheduler). Its load comes as a value beside
    it (`Router.pick`'s `loads`); `load_facts` serves a candidate that publishes none."""

    @property
    def paused(self) -> bool: ...

    @property
    def is_decode(self) -> bool: ...

    @property
    def block_size(self) -> int: ...

    def prefix_hit_tokens(self, req: Request) -> int: ...

    def load_facts(self) -> dict[str, float]: ...

    def priced_hit(self, req: Request) -> tuple[float, int]: ...

    def predicted_wait_ms(self, req: Request, hit_tokens: int) -> float: ...

    def lora_affinity(self, req: Request) -> int: ...


def lora_eligible(affinity: Sequence[int]) -> npt.NDArray[np.bool_]:
    """The candidates of the best LoRA affinity tier (llm-d's order: the adapter loaded there,
    2, before a free adapter slot, 1, before neither, 0): the only ones the rule scores."""
    a = np.asarray(affinity, dtype=np.int64)
    return np.asarray(a == a.max(), bool)


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


@dataclass(frozen=True, slots=True)
class Choice:
    """The router's decision, a value: the index of the candidate chosen, and whether no
    candidate was predicted to meet the deadline (`overflowed`). Choosing sends nothing: the
    caller queues the request there, forwards it, demotes it or refuses it."""

    index: int
    overflowed: bool


def choose(
    hits: Sequence[float] | npt.NDArray[np.float64],
    waits: Sequence[float] | npt.NDArray[np.float64],
    loads: Sequence[float] | npt.NDArray[np.float64],
    target_ms: float,
    overload: str,
    load_weight: float,
    eligible: npt.NDArray[np.bool_] | None = None,
    soonest_on_overflow: bool = True,
) -> Choice:
    """The one placement rule over plain candidates (this daemon's instances and a cluster's
    peer instances alike), each known only by numbers: `hits[i]` the prompt fraction its cache
    is worth, `waits[i]` its predicted ms to the request's first token, `loads[i]` its
    `instance_load`; `eligible` masks candidates out (None: all may take it).

    Among the eligible candidates predicted to meet `target_ms` (all of them with overload
    "off"), the best hit - load_weight * (load - least load among them) wins (first on ties).
    When none is predicted in time the choice overflows: the one predicted to reach the first
    token soonest (`soonest_on_overflow`, the single-daemon rule: it is demoted or refused
    there by the caller), or the best score among all eligible ones (a cluster's rule)."""
    h = np.asarray(hits, dtype=np.float64)
    w = np.asarray(waits, dtype=np.float64)
    ld = np.asarray(loads, dtype=np.float64)
    cand = np.ones(h.size, bool) if eligible is None else np.asarray(eligible, bool)
    if overload == "off":
        pool, overflowed = cand, False
    else:
        pool = cand & (w <= target_ms)
        overflowed = not pool.any()
        if overflowed:
            if soonest_on_overflow:
                return Choice(int(np.argmin(np.where(cand, w, np.inf))), True)
            pool = cand
    score = h - load_weight * (ld - ld[pool].min())
    score[~pool] = -np.inf
    return Choice(int(np.argmax(score)), overflowed)


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
        load_seconds: float = LOAD_SECONDS,
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

    def load(self, s: Candidate) -> float:
        """`instance_load` of a candidate's facts, for a candidate that publishes no load value
        of its own (a bare Scheduler in tests and benches; the daemon's engines publish theirs,
        `InstanceEngine.load`, and the registry hands those to `pick`)."""
        return instance_load(s.load_facts(), self.load_seconds)

    @staticmethod
    def count_load(s: Candidate) -> float:
        """Requests placed or queued per slot, plus KV usage (decode instances)."""
        return instance_load(s.load_facts(), 1.0, by_count=True)

    def pick(
        self,
        schedulers: Sequence[Candidate],
        req: Request,
        loads: Sequence[float] | None = None,
    ) -> int:
        """Index of the instance that should take `req` (a new request: never a decode-role
        instance). `loads[i]`: candidate i's one load value as it published it (None: each
        one's `instance_load` computed here, `Router.load`). A paused instance queues what it is given, so it is chosen only when every
        candidate is paused (the request waits for Resume there). Raises Unavailable when no
        instance can take new requests, CapacityExceeded when the overload policy is
        "refuse" and no instance is predicted to meet the request's deadline."""
        cands = [i for i, s in enumerate(schedulers) if not s.is_decode]
        cands = [i for i in cands if not schedulers[i].paused] or cands
        if not cands:
            raise Unavailable("no instance is ready to take new requests")
        if len(cands) == 1 and self.overload == "off":
            return cands[0]
        self.calibration.update()
        n = max(1, len(req.prompt_token_ids))
        # Block hashes depend on the block size: with mixed sizes, rehash per instance.
        mixed = len({schedulers[i].block_size for i in cands}) > 1
        hits: list[float] = []
        waits: list[float] = []
        load_of: list[float] = []
        for i in cands:
            if mixed:
                use_hashes(req, [])
            s = schedulers[i]
            worth, _ = priced_hit(s, req)
            hits.append(worth / n)
            # The wait with the hit at its price: a host or storage hit saves its recompute
            # less its transfer, at every load (the deadline test at overload included).
            waits.append(self.calibration.factor * predicted_wait_ms(s, req, int(worth)))
            load_of.append(self.load(s) if loads is None else loads[i])
        if mixed:
            use_hashes(req, [])
        target = req.ttft_deadline_ms or self.ttft_target_ms
        # A LoRA request goes where its adapter is loaded, else to a free adapter slot.
        eligible = (
            lora_eligible([schedulers[i].lora_affinity(req) for i in cands])
            if req.lora_name
            else None
        )
        choice = choose(hits, waits, load_of, target, self.overload, self.load_weight, eligible)
        best = cands[choice.index]
        if choice.overflowed:
            self.num_overflowed += 1
            if self.overload == "refuse":
                raise CapacityExceeded(
                    f"request {req.req_id!r}: every instance is predicted to reach its first "
                    f"token after {target:,.0f} ms (the soonest in {waits[choice.index]:,.0f} "
                    f"ms); retry in {max(1.0, (waits[choice.index] - target) / 1e3):.0f} s "
                    "or elsewhere"
                )
            lifecycle.demote(req)  # the choice overflowed: the demote transition
        self.calibration.placed(req, waits[choice.index])
        return best

    def pick_decode(
        self, schedulers: Sequence[Candidate], loads: Sequence[float] | None = None
    ) -> int | None:
        """Least-loaded decode-role instance (by requests per slot and KV usage: a decode
        instance queues no prefill), or None when there is none. `loads[i]`: candidate i's
        load value as it published it (a decode instance's is by count), None: `count_load`."""
        cands = [i for i, s in enumerate(schedulers) if s.is_decode and not s.paused]
        if not cands:
            return None
        if loads is None:
            return min(cands, key=lambda i: self.count_load(schedulers[i]))
        return min(cands, key=lambda i: loads[i])
