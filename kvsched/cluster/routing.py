"""Cluster-wide routing: the instance a new request goes to, on this daemon or a peer.

Candidates are this daemon's instances that accept requests (read live off their engines' facts,
as the single-daemon router does) and the peers' instances known from KV events
(`ClusterIndex`): synced, heard from within `stale_s`, owned (lease) by a live member. Each is
scored by the single-daemon rule (`core.router`): the prompt fraction its cache is worth (GPU
hits whole; its host-memory run and then the shared storage tier's, found by the index's
`HitIndex` like a local instance's `prefix_hit_tokens`, priced by the peer's published
step-cost model: swap-in or fetch vs recompute; storage only for a peer with a storage tier),
minus `load_weight` times its load above the least loaded one, among the candidates whose
predicted wait meets the request's deadline (all of them when none does). A peer's load and
wait are what it last published (predicted backlog) plus the requests this daemon forwarded
to it since. Peers are read as numpy columns (`LoadTable`) and the prompt's runs on every
peer at once (`HitIndex.runs`): a decision's cost follows the prompt, not the fleet's size.
A LoRA request goes only to instances whose workers announced its adapter (a peer's as its
info publishes them), and only to those of the best adapter-affinity tier (llm-d's order:
the adapter running or queued there > a free adapter slot > neither); a request with
multimodal items only to instances that announced them, and one with a structured-output
constraint only to peers whose info says their workers apply it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvsched.cluster.hit_index import price_runs
from kvsched.core import InvalidRequest, KVCacheManager, KvschedError, Request, Unavailable
from kvsched.core.block_hash import use_hashes
from kvsched.core.request import prompt_max_id
from kvsched.core.router import choose
from kvsched.core.step_cost import priced_hit_tokens
from kvsched.server.instances.engine import InstanceEngine
from kvsched.server.instances.models import Limits, misfit

if TYPE_CHECKING:
    from kvsched.cluster.kv_index import ClusterIndex, InstanceView
    from kvsched.server.instances.registry import InstanceRegistry


@dataclass(frozen=True, slots=True)
class RemoteInstance:
    """A peer's instance chosen for a new request: a value (the request's record holds it in
    its `RemotePeer` location; the forwarder relays the request's outputs from it)."""

    instance_id: str
    daemon_id: str
    address: str


@dataclass(frozen=True, slots=True)
class Route:
    """A routing decision: `target` (an engine here, or a peer's instance at index `slot`;
    -1 for an engine), and whether the instance holds part of the prompt (`prefix`)."""

    target: InstanceEngine | RemoteInstance
    slot: int
    prefix: bool
    lora: str = ""  # the request's LoRA adapter (a peer's instance counts it as held there)


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
        self.refresh_s = 1.0  # ownership and membership re-read at least this often
        self._base: npt.NDArray[np.bool_] = np.zeros(0, bool)
        self._sizes: list[int] = []  # the eligible peers' block sizes
        self._models: list[str] = []  # per slot, the model it serves
        self._model_masks: dict[str, npt.NDArray[np.bool_]] = {}
        self._max_model_len: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._vocab: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._any_vocab = False
        self._multimodal: npt.NDArray[np.bool_] = np.zeros(0, bool)
        self._structured: npt.NDArray[np.bool_] = np.zeros(0, bool)
        self._lora_masks: dict[str, npt.NDArray[np.bool_]] = {}  # adapter -> slots that have it
        self._mask_version, self._mask_at = -1, float("-inf")

    def _hashes(
        self, req: Request, block_size: int, by_size: dict[int, list[bytes]]
    ) -> list[bytes]:
        """The prompt's chained block hashes for `block_size` (computed once per size)."""
        got = by_size.get(block_size)
        if got is None:
            hasher = self._hashers.get(block_size)
            if hasher is None:
                hasher = self._hashers[block_size] = KVCacheManager(block_size, 0)
            use_hashes(req, [])
            hasher.ensure_hashes(req, (req.num_tokens - 1) // block_size)
            got = by_size[block_size] = req.block_hashes
        return got

    def remote_candidates(self, now: float) -> list[InstanceView]:
        """The peers' instances a request may go to now (the rule of module docstring)."""
        views = self.index.slots
        return [v for i in np.flatnonzero(self._remote_mask(now)).tolist() if (v := views[i])]

    def refresh(self) -> None:
        """Re-read which indexed instances may take requests (synced, with a load, a peer's,
        not a decode instance, leased to a live member): a loop over every instance, so it
        runs when the index gains or resyncs one, when the daemon's membership and lease
        views were refreshed (`ClusterNode`, every 0.2 s) and at least every `refresh_s`,
        never per decision. An
        instance this daemon still knows but has no worker of (taken out: its lease went to
        a peer while this daemon was paused or cut off) is the peer's to take requests."""
        index, me, engines = self.index, self.daemon_id, self.registry.engines
        owner, live = self.owner_of.get, self.address_of
        ok = [
            v is not None
            and v.synced
            and bool(v.load)
            and v.daemon != me
            and v.daemon in live
            and owner(v.instance_id) == v.daemon
            and not _attached_here(engines.get(v.instance_id))
            and v.role != "decode"  # it only takes prefilled requests (P/D): never a new one
            for v in index.slots
        ]
        self._base = np.array(ok, dtype=bool)
        default = self.registry.config.model
        self._models = [(v.model or default) if v is not None else "" for v in index.slots]
        self._model_masks = {}
        self._max_model_len = np.array(
            [v.max_model_len if v is not None else 0 for v in index.slots], np.int64
        )
        self._vocab = np.array(
            [v.vocab_size if v is not None else 0 for v in index.slots], np.int64
        )
        self._any_vocab = bool((self._vocab > 0).any())
        self._multimodal = np.array([v is None or v.multimodal for v in index.slots], bool)
        self._structured = np.array(
            [v is not None and v.structured_outputs for v in index.slots], bool
        )
        self._lora_masks = {}
        sizes = index.table.block_size[: len(ok)][self._base]
        self._sizes = sorted({int(b) for b in sizes.tolist()})
        self._mask_version, self._mask_at = index.version, time.monotonic()

    def _remote_mask(self, now: float) -> npt.NDArray[np.bool_]:
        """Per slot: an eligible peer instance heard from within stale_s."""
        index = self.index
        if index.version != self._mask_version or now - self._mask_at > self.refresh_s:
            self.refresh()
        base = self._base
        return base & (index.table.heard[: base.size] >= now - self.stale_s)

    def peer_models(self) -> set[str]:
        """The models the peers' instances serve (known from their published info)."""
        return {
            v.model for v in self.index.instances.values() if v.model and v.daemon != self.daemon_id
        }

    def peer_ready_models(self) -> set[str]:
        """The models the peers' live instances serve now (what `registry.model_for` reads
        once per request: names only, no `Limits` per instance)."""
        default = self.registry.config.model
        return {v.model or default for v in self.remote_candidates(time.monotonic())}

    def peer_limits(self) -> list[Limits]:
        """The limits of the peers' live instances, with their LoRA adapters (ListModels counts
        them as ready; a request naming an adapter only a peer's workers announced is known)."""
        cfg = self.registry.config
        return [
            Limits(
                v.model or cfg.model,
                v.max_model_len or cfg.engine.scheduler.max_model_len,
                v.vocab_size,
                structured_outputs=v.structured_outputs,
                loras=v.loras,
                multimodal=v.multimodal,
            )
            for v in self.remote_candidates(time.monotonic())
        ]

    def _refuse_by_peers(self, req: Request, model: str, known: list[InstanceView]) -> None:
        """InvalidRequest naming the limit when peers serve `model` but `req` fits none."""
        cfg = self.registry.config
        lims = [
            Limits(
                model,
                v.max_model_len,
                v.vocab_size,
                structured_outputs=v.structured_outputs,
                multimodal=v.multimodal,
            )
            for v in known
            if (v.model or cfg.model) == model and v.max_model_len
        ]
        if lims:
            best = max(
                lims,
                key=lambda lim: (
                    lim.multimodal,
                    lim.structured_outputs,
                    lim.max_model_len,
                    lim.vocab_size,
                ),
            )
            why = misfit(req, best)
            if why is not None:
                raise InvalidRequest(f"request {req.req_id!r}: {why}")

    def _fits(self, req: Request, model: str) -> npt.NDArray[np.bool_]:
        """Per slot: the instance serves `model` and `req` fits its published limits (an
        instance that published none is taken to serve the configured model, unchecked):
        `server.models.misfit`'s rule over the columns read at `refresh`."""
        mask = self._model_masks.get(model)
        if mask is None:
            mask = self._model_masks[model] = np.array([m == model for m in self._models], bool)
        n, sp = len(req.prompt_token_ids), req.sampling
        if req.logprobs is not None:  # the relay carries no log-probabilities: this daemon's
            return np.zeros(mask.shape, bool)
        mml, vocab = self._max_model_len, self._vocab
        fits: npt.NDArray[np.bool_] = mask & ((mml == 0) | (n + sp.max_tokens <= mml))
        if req.lora_name:  # only instances whose workers announced its adapter
            fits &= self._lora_mask(req.lora_name)
        if req.mm_ranges:  # only instances whose workers run multimodal items
            fits &= self._multimodal
        if sp.structured is not None:  # only instances whose workers apply the constraint
            fits &= self._structured
        if not self._any_vocab:  # no peer announced a vocabulary: skip the scan of the prompt
            return fits
        top = max(prompt_max_id(req), max(sp.stop_token_ids, default=-1))
        return fits & ((vocab <= 0) | (top < vocab))

    def _lora_mask(self, name: str) -> npt.NDArray[np.bool_]:
        """Per slot: the instance's workers announced LoRA adapter `name` (kept until the
        next `refresh`: adapters are announced once, in the workers' Hello)."""
        mask = self._lora_masks.get(name)
        if mask is None:
            views = self.index.slots[: len(self._models)]  # (the slots `refresh` read)
            has = [v is not None and any(n == name for n, _ in v.loras) for v in views]
            mask = self._lora_masks[name] = np.array(has, bool)
        return mask

    def route(
        self,
        req: Request,
        model: str = "",
        hashes_by_size: dict[int, list[bytes]] | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> InstanceEngine | RemoteInstance:
        """Where `req` goes: `choose`, then `commit` (the decision recorded as sent). With no
        peer instance known this is the daemon's own routing (including its errors:
        Unavailable when nothing is ready). hashes_by_size: the prompt's chained block hashes
        per block size when the caller has them already. exclude: peers' daemon ids not to
        choose (they refused the request just now)."""
        t0 = time.perf_counter()
        try:
            got = self.choose(
                req, model or self.registry.model_for(""), dict(hashes_by_size or {}), exclude
            )
            return self.commit(got)
        finally:
            self.route_s.append(time.perf_counter() - t0)

    def decode_peer(self, model: str, count: bool = True) -> RemoteInstance | None:
        """A peer's decode instance of `model` for a request a prefill instance here hands
        off (P/D across daemons): synced, heard from within stale_s, owned by a live member;
        the least loaded (its published load plus the hand-offs sent to it since). None when
        there is none. `count`: the choice is one more request sent to it."""
        index, now, default = self.index, time.monotonic(), self.registry.config.model
        t = index.table
        best: tuple[float, int] | None = None
        for i, v in enumerate(index.slots):
            if (
                v is None
                or v.role != "decode"
                or not v.synced
                or v.daemon == self.daemon_id
                or v.daemon not in self.address_of
                or self.owner_of.get(v.instance_id, v.daemon) != v.daemon  # (unknown yet:
                or (v.model or default) != model  # its publisher's, a wrong one refuses)
                or t.heard[i] < now - self.stale_s
            ):
                continue
            load = float(t.load[i]) + float(t.sent[i]) / max(1.0, float(t.max_num_seqs[i]))
            if best is None or load < best[0]:
                best = (load, i)
        if best is None:
            return None
        v = index.slots[best[1]]
        assert v is not None
        if count:
            t.sent[best[1]] += 1
            v.sent_since_load += 1
            self.num_forwarded += 1
        return RemoteInstance(v.instance_id, v.daemon, self.address_of[v.daemon])

    def route_percentiles_us(self) -> tuple[float, float]:
        """Median and p99 of the recent routing decisions, microseconds (0 when none)."""
        xs = sorted(self.route_s)
        if not xs:
            return 0.0, 0.0
        return 1e6 * xs[len(xs) // 2], 1e6 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]

    def choose(
        self,
        req: Request,
        model: str,
        by_size: dict[int, list[bytes]],
        exclude: frozenset[str] = frozenset(),
    ) -> Route:
        """The decision, a value: this daemon's engine or a peer's instance slot, scored by
        `core.router.choose` over plain candidates (hit fraction, predicted wait, load) of
        both kinds, none of the daemons in `exclude`. Nothing is counted as sent (`commit`
        does)."""
        elig = self._remote_mask(time.monotonic()) & self._fits(req, model)
        if exclude:
            views = self.index.slots[: elig.size]
            elig &= np.array([v is None or v.daemon not in exclude for v in views], bool)
        if not elig.any():
            try:
                return Route(self.registry.route(req, model), -1, False)
            except Unavailable:
                # None of the model here: the peers' instances of it, if any, say why not.
                self._refuse_by_peers(req, model, self.remote_candidates(time.monotonic()))
                raise
        engines = [e for e in self.registry.engines.values() if e.accepting and not e.is_decode]
        if engines:  # (with none, `candidates` could only raise Unavailable)
            try:
                engines = self.registry.candidates(req, model, engines)
            except KvschedError:
                engines = []  # none here fits: a peer's does
        router = self.registry.router
        n = max(1, len(req.prompt_token_ids))
        local_hits: list[float] = []
        local_loads: list[float] = []
        local_waits: list[float] = []
        for e in engines:
            use_hashes(req, self._hashes(req, e.block_size, by_size))
            worth, _ = e.priced_hit(req)
            local_hits.append(worth / n)
            local_loads.append(e.load)
            local_waits.append(router.calibration.factor * e.predicted_wait_ms(req, int(worth)))
        hits, waits, loads = self._remote_scores(req, elig.size, by_size, n, model)
        use_hashes(req, [])  # the instance chosen hashes with its own block size
        all_hits = hits
        if engines:  # this daemon's candidates first, then the peers' slots
            all_hits = np.concatenate([np.asarray(local_hits), hits])
            waits = np.concatenate([np.asarray(local_waits), waits])
            loads = np.concatenate([np.asarray(local_loads), loads])
            elig = np.concatenate([np.ones(len(engines), bool), elig])
        if req.lora_name:  # only the best adapter-affinity tier (loaded > free slot > neither)
            elig = elig & self._best_affinity(req.lora_name, engines, elig, req)
        choice = choose(
            all_hits,
            waits,
            loads,
            req.ttft_deadline_ms or router.ttft_target_ms,
            router.overload,
            self.load_weight,
            eligible=elig,
            soonest_on_overflow=False,
        )
        if choice.overflowed:
            router.num_overflowed += 1
        i = choice.index
        prefix = bool(all_hits[i] > 0)
        if i < len(engines):
            # The chosen instance's hashes: its scheduler extends them instead of rehashing.
            use_hashes(req, by_size.get(engines[i].block_size, []))
            return Route(engines[i], -1, prefix)
        slot = i - len(engines)
        v = self.index.slots[slot]
        assert v is not None
        return Route(
            RemoteInstance(v.instance_id, v.daemon, self.address_of[v.daemon]),
            slot,
            prefix,
            req.lora_name,
        )

    def _best_affinity(
        self, name: str, engines: list[InstanceEngine], elig: npt.NDArray[np.bool_], req: Request
    ) -> npt.NDArray[np.bool_]:
        """Per candidate (this daemon's `engines`, then the peers' slots): whether it is of
        the best LoRA affinity tier among the eligible ones (`core.router.lora_eligible`'s
        rule: the adapter running or queued there, else a free adapter slot, else any; a
        peer's from what it published plus the requests of the adapter forwarded to it since)."""
        aff = np.full(elig.size, -1, np.int64)
        for k, e in enumerate(engines):
            aff[k] = e.lora_affinity(req)
        views = self.index.slots
        for k in np.flatnonzero(elig[len(engines) :]).tolist():
            v = views[k]
            if v is not None:
                aff[len(engines) + k] = v.lora_affinity(name)
        best = aff[elig].max() if elig.any() else -1
        return np.asarray(aff == best, bool)

    def commit(self, got: Route) -> InstanceEngine | RemoteInstance:
        """Record a decision as sent: the routing counters, and for a peer's instance one more
        request in flight to it until its next published load (`LoadTable.sent`)."""
        if got.prefix:
            self.num_prefix_routed += 1
        if got.slot < 0:
            self.num_local += 1
            return got.target
        self.index.table.sent[got.slot] += 1
        v = self.index.slots[got.slot]
        if v is not None:
            v.sent_since_load += 1
            if got.lora:
                v.loras_sent.add(got.lora)
        self.num_forwarded += 1
        return got.target

    def _remote_scores(
        self, req: Request, size: int, by_size: dict[int, list[bytes]], n: int, model: str = ""
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per slot (the first `size`; the caller masks the ineligible): the prompt fraction
        its cache is worth (GPU hits whole, host and storage hits priced by its published
        step-cost model: swap-in or fetch vs recompute, `hit_index.price_runs`), its predicted wait for the request in ms (its published backlog
        plus the request's uncached prefill) and its load: the load value it published
        (`InstanceEngine.load`) plus the requests forwarded to it since, per slot."""
        t, index = self.index.table, self.index
        router = self.registry.router
        bs = t.block_size[:size]
        worth, cached, stored = index.hits.tier_tokens(
            lambda b: self._hashes(req, b, by_size),
            self._sizes,
            bs,
            t.fetch_block_ms[:size],
            model or self.registry.model_for(""),  # the storage tier's namespace
        )
        a_tok, a_attn = t.prefill_token_ms[:size], t.attention_ms[:size]
        j = np.flatnonzero(cached > worth)  # host or storage hits: priced against recompute
        if 0 < j.size <= 16:  # few (the usual case): one by one is cheaper than arrays
            host, swap, fetch = cached - worth - stored, t.swap_block_ms, t.fetch_block_ms
            for k in j.tolist():
                runs = [
                    (host[k], swap[k] * host[k] / bs[k]),
                    (stored[k], fetch[k] * stored[k] / bs[k]),
                ]
                worth[k] = priced_hit_tokens(worth[k], runs, a_tok[k], a_attn[k])
        elif j.size:
            worth[j] = price_runs(
                worth[j],
                (cached - worth - stored)[j],
                stored[j],
                t.swap_block_ms[j] / bs[j],
                t.fetch_block_ms[j] / bs[j],
                a_tok[j],
                a_attn[j],
            )
        ntok = float(len(req.prompt_token_ids))
        start = np.minimum(worth, ntok - 1)  # host and storage hits at their price
        own = a_tok * (ntok - start) + a_attn * (ntok * ntok - start * start) / 2
        backlog = t.backlog_ms[:size]
        waits = router.calibration.factor * (backlog + own)
        loads = t.load[:size] + t.sent[:size] / t.max_num_seqs[:size]
        return worth / n, waits, loads


def _attached_here(eng: InstanceEngine | None) -> bool:
    """Whether a worker of this instance is attached to this daemon now."""
    return eng is not None and bool(eng.ranks)
