"""Cluster-wide routing: the instance a new request goes to, on this daemon or a peer.

Candidates are this daemon's instances that accept requests (read live off their schedulers,
as the single-daemon router does) and the peers' instances known from KV events
(`ClusterIndex`): synced, heard from within `stale_s`, owned (lease) by a live member. Each is
scored by the single-daemon rule (`core.router.best_by_score`): the fraction of the prompt its
cache holds, minus `load_weight` times its load above the least loaded one. A peer's load is
what it last published plus the requests this daemon forwarded to it since.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsched.core import (
    InvalidRequest,
    KVCacheManager,
    KvschedError,
    Request,
    Role,
    Unavailable,
)
from kvsched.core.router import backlog_load, best_by_score, load_value
from kvsched.server.engine import InstanceEngine
from kvsched.server.models import Limits, misfit

if TYPE_CHECKING:
    from kvsched.cluster.kv_index import ClusterIndex, InstanceView
    from kvsched.server.registry import InstanceRegistry


@dataclass(eq=False)
class RemoteInstance:
    """A peer's instance, as the request table sees it for a forwarded request: it never
    holds the request itself (`holds` is False); the forwarder relays its outputs."""

    instance_id: str
    daemon_id: str
    address: str
    role: Role = Role.MIXED
    sched: None = None
    is_decode: bool = False

    def holds(self, req: Request) -> bool:
        return False

    def wake(self) -> None:
        pass

    def sinks_changed(self) -> None:  # a Resume took its outputs: the forwarder hands them on
        pass


class ClusterRouter:
    def __init__(
        self,
        daemon_id: str,
        registry: InstanceRegistry,
        index: ClusterIndex,
        address_of: dict[str, str],
        owner_of: dict[str, str],
        stale_s: float = 2.0,
    ) -> None:
        self.daemon_id = daemon_id
        self.registry = registry
        self.index = index
        self.address_of = address_of  # live daemon id -> address (the membership's view)
        self.owner_of = owner_of  # instance id -> owning daemon id (the leases' view)
        self.stale_s = stale_s
        self.load_weight = registry.router.load_weight
        self._hashers: dict[int, KVCacheManager] = {}
        self.num_local = 0
        self.num_forwarded = 0
        self.num_prefix_routed = 0  # placements on an instance holding part of the prompt
        self.route_s: collections.deque[float] = collections.deque(maxlen=2048)

    def _hashes(
        self, req: Request, block_size: int, by_size: dict[int, list[bytes]]
    ) -> list[bytes]:
        """The prompt's chained block hashes for `block_size` (computed once per size)."""
        got = by_size.get(block_size)
        if got is None:
            hasher = self._hashers.get(block_size)
            if hasher is None:
                hasher = self._hashers[block_size] = KVCacheManager(block_size, 0)
            req.block_hashes = []
            hasher.ensure_hashes(req, (req.num_tokens - 1) // block_size)
            got = by_size[block_size] = req.block_hashes
        return got

    def remote_candidates(self, now: float) -> list[InstanceView]:
        out = []
        for iid, v in self.index.instances.items():
            if not v.synced or v.daemon == self.daemon_id or not v.load:
                continue
            if now - v.heard > self.stale_s or iid in self.registry.engines:
                continue
            if self.owner_of.get(iid) != v.daemon or v.daemon not in self.address_of:
                continue
            out.append(v)
        return out

    def peer_models(self) -> set[str]:
        """The models the peers' instances serve (known from their published info)."""
        return {
            v.model for v in self.index.instances.values() if v.model and v.daemon != self.daemon_id
        }

    def peer_limits(self) -> list[Limits]:
        """The limits of the peers' live instances (ListModels counts them as ready)."""
        cfg = self.registry.config
        return [
            Limits(
                v.model or cfg.model,
                v.max_model_len or cfg.engine.scheduler.max_model_len,
                v.vocab_size,
            )
            for v in self.remote_candidates(time.monotonic())
        ]

    def _refuse_by_peers(self, req: Request, model: str, known: list[InstanceView]) -> None:
        """InvalidRequest naming the limit when peers serve `model` but `req` fits none."""
        cfg = self.registry.config
        lims = [
            Limits(model, v.max_model_len, v.vocab_size)
            for v in known
            if (v.model or cfg.model) == model and v.max_model_len
        ]
        if lims:
            best = max(lims, key=lambda lim: (lim.max_model_len, lim.vocab_size))
            why = misfit(req, best)
            if why is not None:
                raise InvalidRequest(f"request {req.req_id!r}: {why}")

    def _remote_fits(self, req: Request, model: str, v: InstanceView) -> bool:
        """Whether a peer's instance serves `model` and `req` fits its published limits (an
        instance that published none is taken to serve the configured model, unchecked)."""
        if (v.model or self.registry.config.model) != model:
            return False
        if not v.max_model_len:
            return True
        return misfit(req, Limits(model, v.max_model_len, v.vocab_size)) is None

    def route(self, req: Request, model: str = "") -> InstanceEngine | RemoteInstance:
        """Where `req` goes. With no peer instance known this is the daemon's own routing
        (including its errors: Unavailable when nothing is ready)."""
        t0 = time.perf_counter()
        try:
            return self._route(req, model or self.registry.model_for(""))
        finally:
            self.route_s.append(time.perf_counter() - t0)

    def route_percentiles_us(self) -> tuple[float, float]:
        """Median and p99 of the recent routing decisions, microseconds (0 when none)."""
        xs = sorted(self.route_s)
        if not xs:
            return 0.0, 0.0
        return 1e6 * xs[len(xs) // 2], 1e6 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]

    def _route(self, req: Request, model: str) -> InstanceEngine | RemoteInstance:
        known = self.remote_candidates(time.monotonic())
        remotes = [v for v in known if self._remote_fits(req, model, v)]
        if not remotes:
            try:
                eng = self.registry.route(req, model)
            except Unavailable:
                # None of the model here: the peers' instances of it, if any, say why not.
                self._refuse_by_peers(req, model, known)
                raise
            self.num_local += 1
            return eng
        engines = [
            e
            for e in self.registry.engines.values()
            if e.accepting and not e.is_decode and e.sched is not None
        ]
        try:
            engines = self.registry.candidates(req, model, engines)
        except KvschedError:
            engines = []  # none here fits: a peer's does
        router = self.registry.router
        n = max(1, len(req.prompt_token_ids))
        hits: list[float] = []
        loads: list[float] = []
        by_size: dict[int, list[bytes]] = {}  # the prompt's block hashes, once per block size
        for e in engines:
            sched = e.sched
            assert sched is not None
            req.block_hashes = self._hashes(req, sched.block_size, by_size)
            hits.append(sched.prefix_hit_tokens(req) / n)
            loads.append(router.load(sched))
        for v in remotes:
            bs = v.block_size or 16
            hits.append(v.prefix_blocks(self._hashes(req, bs, by_size)) * bs / n)
            ld = v.load
            # Requests forwarded since the peer last published count as one slot each.
            sent = v.sent_since_load / max(1.0, ld.get("max_num_seqs", 1.0))
            if "predicted_backlog_ms" in ld:  # the peer's own cost model, as for local ones
                load = backlog_load(
                    ld["predicted_backlog_ms"], ld.get("kv_usage", 0.0), router.load_seconds
                )
                loads.append(load + sent)
                continue
            loads.append(
                load_value(
                    ld.get("running", 0.0),
                    ld.get("waiting", 0.0) + v.sent_since_load,
                    ld.get("max_num_seqs", 1.0),
                    ld.get("kv_usage", 0.0),
                )
            )
        req.block_hashes = []  # the instance chosen hashes with its own block size
        i = best_by_score(hits, loads, self.load_weight)
        if hits[i] > 0:
            self.num_prefix_routed += 1
        if i < len(engines):
            self.num_local += 1
            return engines[i]
        v = remotes[i - len(engines)]
        v.sent_since_load += 1
        self.num_forwarded += 1
        return RemoteInstance(v.instance_id, v.daemon, self.address_of[v.daemon])
