"""The storage tier in the cluster index (issue 25): storage KV events go into ONE cluster-wide
set per model, any instance with a storage tier continues its run there, and routing prices a
storage hit (fetch) against recomputing it with the peer's published step-cost model."""

from __future__ import annotations

import random
import time

import numpy as np

from kvsched.cluster.hit_index import HitIndex, keys_of, price_runs
from kvsched.cluster.kv_index import ClusterIndex, decode, encode_batch, encode_snapshot
from kvsched.cluster.routing import ClusterRouter, RemoteInstance
from kvsched.core.kv_events import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored
from kvsched.core.step_cost import priced_hit_tokens
from kvsched.server.config.settings import ServerConfig
from kvsched.server.instances.registry import InstanceRegistry
from kvsched.server.telemetry.hooks import Telemetry
from tests.core.factories import make_request, make_scheduler

BS = 16
MODEL = "m"


def _load(backlog_ms: float, fetch_ms: float | None) -> dict[str, float]:
    load = {"running": 0.0, "waiting": 0.0, "max_num_seqs": 64.0, "kv_usage": 0.0}
    load |= {"predicted_backlog_ms": backlog_ms, "prefill_token_ms": 0.05}
    load |= {"attention_ms": 1e-6, "swap_block_ms": 0.1}
    if fetch_ms is not None:  # published only by an instance with a storage tier
        load["fetch_block_ms"] = fetch_ms
    return load


def _peer(
    index: ClusterIndex,
    iid: str,
    backlog_ms: float,
    fetch_ms: float | None,
    gpu: list[bytes] | None = None,
) -> None:
    snap = encode_snapshot(
        iid, "peer", "e", 0, BS, _load(backlog_ms, fetch_ms), gpu or [], info={"model": MODEL}
    )
    index.apply_snapshot(decode(snap), time.monotonic())


def _store(index: ClusterIndex, iid: str, seq: int, stored: list[bytes], removed=()) -> None:  # type: ignore[no-untyped-def]
    v = index.instances[iid]
    events = [BlockStored(stored, None, [], BS, None, STORAGE)]
    if removed:
        events.append(BlockRemoved(list(removed), STORAGE))
    events.append(AllBlocksCleared(STORAGE))  # one instance cannot clear the shared store
    batch = encode_batch(iid, "peer", "e", seq, 0.0, BS, v.load, events, info={"model": MODEL})
    assert index.apply_batch(decode(batch), time.monotonic())


def _prompt_hashes(prompt: list[int]) -> list[bytes]:
    s = make_scheduler(block_size=BS)
    req = make_request(prompt, max_tokens=2)
    s.kv.ensure_hashes(req, (req.num_tokens - 1) // BS)
    return list(req.block_hashes)


def test_storage_events_fill_one_shared_set_that_every_storage_instance_continues_into() -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(3, 30000) for _ in range(10 * BS + 3)]
    blocks = _prompt_hashes(prompt)  # 10 full blocks
    index = ClusterIndex()
    _peer(index, "writer", 0.0, 0.2, gpu=blocks[:2])  # holds 2 blocks on its GPU
    _peer(index, "reader", 0.0, 0.2)  # a storage tier, holds nothing itself
    _peer(index, "plain", 0.0, None)  # no storage tier
    _store(index, "writer", 1, blocks[:8], removed=blocks[6:8])  # stored 0-7, 6-7 failed
    assert index.hits.stored(MODEL) == set(keys_of(blocks[:6]))
    assert not index.instances["writer"].hashes - set(keys_of(blocks[:2])), "not per instance"
    t = index.table
    size = len(index.slots)
    gpu, cached, stored = index.hits.tier_tokens(
        lambda b: blocks, [BS], t.block_size[:size], t.fetch_block_ms[:size], MODEL
    )
    slot = {iid: v.slot for iid, v in index.instances.items()}
    # writer: 2 GPU blocks, then 4 more in storage; reader: all 6 from storage; plain: nothing
    assert (gpu[slot["writer"]], stored[slot["writer"]], cached[slot["writer"]]) == (32, 64, 96)
    assert (gpu[slot["reader"]], stored[slot["reader"]], cached[slot["reader"]]) == (0, 96, 96)
    assert (gpu[slot["plain"]], stored[slot["plain"]], cached[slot["plain"]]) == (0, 0, 0)
    # another model's store is another namespace
    gpu_other, cached_other, stored_other = index.hits.tier_tokens(
        lambda b: blocks, [BS], t.block_size[:size], t.fetch_block_ms[:size], "other"
    )
    assert not stored_other.any() and (cached_other == gpu_other).all()


def test_storage_run_continues_after_the_host_run() -> None:
    chain = [bytes([i]) * 16 for i in range(12)]
    idx = HitIndex()
    idx.add(GPU, 0, keys_of(chain[:3]))
    idx.add(CPU, 0, keys_of(chain[3:5]))
    idx.add(STORAGE, 0, keys_of(chain[5:9] + chain[10:]), "m")
    gpu, total, ends = idx.runs(chain, 2, "m")
    assert ends is not None
    assert (int(gpu[0]), int(total[0]), int(ends[total[0]])) == (3, 5, 9)
    assert (int(gpu[1]), int(total[1]), int(ends[total[1]])) == (0, 0, 0)  # block 0 not stored
    assert int(ends[10]) == 12


def test_vectorised_pricing_equals_the_step_cost_models() -> None:
    rng = np.random.default_rng(0)
    n = 200
    gpu = rng.integers(0, 500, n).astype(float)
    host = rng.integers(0, 300, n) * (rng.random(n) < 0.6)
    stored = rng.integers(0, 300, n) * (rng.random(n) < 0.6)
    swap, fetch = rng.random(n) * 0.02, rng.random(n) * 0.05
    a_tok, a_attn = rng.random(n) * 0.1, rng.random(n) * 1e-5
    a_tok[:5] = 0.0  # free recompute: nothing is worth moving
    a_attn[:5] = 0.0
    got = price_runs(gpu, host.astype(float), stored.astype(float), swap, fetch, a_tok, a_attn)
    for k in range(n):
        runs = [(float(host[k]), swap[k] * host[k]), (float(stored[k]), fetch[k] * stored[k])]
        want = priced_hit_tokens(gpu[k], runs, a_tok[k], a_attn[k])
        assert abs(got[k] - want) <= 1e-9 * max(1.0, want), k


def _router(index: ClusterIndex) -> ClusterRouter:
    cfg = ServerConfig()
    cfg.model = MODEL
    registry = InstanceRegistry(cfg, Telemetry())
    owners = {iid: "peer" for iid in index.instances}
    return ClusterRouter("me", registry, index, {"peer": "127.0.0.1:5000"}, owners)


def test_router_sends_a_stored_prompt_to_a_storage_peer_only_while_fetching_beats_recompute() -> (
    None
):
    rng = random.Random(7)
    prompt = [rng.randrange(3, 30000) for _ in range(40 * BS + 5)]  # 40 full blocks
    blocks = _prompt_hashes(prompt)
    for fetch_ms, expect in ((0.01, "p-store"), (80.0, "p-idle")):
        index = ClusterIndex()
        # p-store has a storage tier and is busier; p-idle has none and is idle.
        _peer(index, "p-store", 300.0, fetch_ms)
        _peer(index, "p-idle", 0.0, None)
        _peer(index, "writer", 5000.0, fetch_ms)  # wrote the prompt; far too busy to pick
        _store(index, "writer", 1, blocks)
        got = _router(index).route(make_request(prompt, max_tokens=2), model=MODEL)
        assert isinstance(got, RemoteInstance) and got.instance_id == expect, (fetch_ms, got)
