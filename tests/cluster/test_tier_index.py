"""The cluster index over every tier (issue 25): the host tier's KV events (medium "cpu"), the
index that keeps them per instance and per medium, over a real nats-server too, and routing that
prices a peer's host hit (swap-in) against recomputing the prompt."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvsched.cluster.hit_index import HitIndex, keys_of
from kvsched.cluster.kv_index import ClusterIndex, decode, encode_batch, encode_snapshot
from kvsched.cluster.kv_stream import KvStream
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.cluster.routing import ClusterRouter, RemoteInstance
from kvsched.core import InvalidRequest, Scheduler
from kvsched.core.kv_events import CPU, GPU, BlockRemoved
from kvsched.core.protocol import StructuredOutput
from kvsched.server.config.settings import ServerConfig
from kvsched.server.instances.registry import InstanceRegistry
from kvsched.server.telemetry.hooks import Telemetry
from tests.core.factories import make_request, make_scheduler, step

BS = 16


def host_sched(**kw: object) -> Scheduler:
    """8 GPU blocks, 24 host blocks, every registered block copied to host (write_through)."""
    s = make_scheduler(
        block_size=BS,
        num_gpu_blocks=8,
        num_host_blocks=24,
        host_write_policy="write_through",
        prealloc_threshold=0,
        prealloc_blocks=1,
        **kw,
    )
    s.enable_kv_events()
    return s


def serve(s: Scheduler, prompt: list[int]) -> None:
    req = make_request(prompt, max_tokens=2)
    s.add_request(req)
    for _ in range(200):
        if req.is_finished:
            break
        step(s)
    assert req.is_finished
    step(s)  # the last swap-outs' acknowledgement


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(3 * BS + 5)] for _ in range(n)]


def test_host_tier_publishes_cpu_stored_and_removed_and_the_index_matches_both_tiers() -> None:
    s = host_sched()
    idx = ClusterIndex()
    idx.apply_snapshot(  # the view starts empty at seq 0 (a publisher's first snapshot)
        {
            "instance": "i0",
            "daemon": "d",
            "epoch": "e",
            "seq": 0,
            "block_size": BS,
            "block_hashes": [],
        }
    )
    kinds = set()
    for seq, p in enumerate(
        prompts(14), 1
    ):  # 14 x 3 blocks through 8 GPU and 24 host blocks: both evict
        serve(s, p)
        events = s.take_kv_events()
        kinds |= {(type(e).__name__, e.medium) for e in events}
        batch = encode_batch("i0", "d", "e", seq, 0.0, BS, s.published_load(), events)
        assert idx.apply_batch(decode(batch))
    assert ("BlockStored", CPU) in kinds and ("BlockRemoved", CPU) in kinds
    assert ("BlockStored", GPU) in kinds and ("BlockRemoved", GPU) in kinds
    v = idx.instances["i0"]
    assert v.hashes == set(keys_of(s.cached_block_hashes()))
    assert v.host == set(keys_of(s.host_block_hashes())) and len(v.host) == 24


def test_failed_swap_in_source_is_a_cpu_block_removed() -> None:
    s = host_sched()
    s.kv.host.pool.events = None
    # A host block forgotten (a failed swap-in's suspect source) is recorded under cpu.
    serve(s, prompts(1)[0])
    s.take_kv_events()
    host = s.kv.host
    hb = next(iter(host.pool.cached.values()))
    h = host.pool.block_hash[hb]
    host._sync_events()
    host.pool.forget(hb)
    assert [e for e in s.take_kv_events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved([h], CPU)
    ]


def test_hit_index_runs_equal_each_instance_walked_alone() -> None:
    rng = random.Random(3)
    chain = [bytes([i]) * 4 for i in range(40)]
    idx, views = HitIndex(), []
    for slot in range(30):
        gpu = set(chain[: rng.randrange(0, 40)]) - {chain[rng.randrange(40)]}
        host = {h for h in chain if rng.random() < 0.6}
        idx.add(GPU, slot, keys_of(list(gpu)))
        idx.add(CPU, slot, keys_of(list(host)))
        views.append((gpu, host))
    for slot in range(0, 30, 3):  # removals are indexed too
        gone = [h for h in chain if rng.random() < 0.2]
        idx.remove(CPU, slot, keys_of(gone))
        views[slot][1].difference_update(gone)
    for start in (0, 5, 17):
        q = chain[start:]
        g_len, all_len, _ = idx.runs(q, 30)
        for slot, (gpu, host) in enumerate(views):
            g = next((j for j, h in enumerate(q) if h not in gpu), len(q))
            t = next((j for j, h in enumerate(q[g:], g) if h not in host), len(q))
            assert (int(g_len[slot]), int(all_len[slot])) == (g, t), (slot, start)


def _router(index: ClusterIndex, owners: dict[str, str]) -> ClusterRouter:
    registry = InstanceRegistry(ServerConfig(), Telemetry())
    addresses = {d: f"127.0.0.1:{5000 + k}" for k, d in enumerate(set(owners.values()))}
    return ClusterRouter("me", registry, index, addresses, owners)


def _peer(index: ClusterIndex, iid: str, host: list[bytes], backlog_ms: float, swap_ms: float):  # type: ignore[no-untyped-def]
    load = {"running": 0.0, "waiting": 0.0, "max_num_seqs": 64.0, "kv_usage": 0.0}
    load |= {"predicted_backlog_ms": backlog_ms, "prefill_token_ms": 0.05}
    load |= {"attention_ms": 1e-6, "swap_block_ms": swap_ms}
    index.apply_snapshot(
        decode(encode_snapshot(iid, "peer", "e", 0, BS, load, [], host_hashes=host)),
        time.monotonic(),
    )


def test_router_prefers_a_peers_host_hit_only_while_swapping_in_beats_recomputing() -> None:
    s = host_sched()  # a scheduler only to hash the prompt's blocks the way instances do
    prompt = prompts(1, seed=9)[0] * 8  # 424 tokens, 26 full blocks
    req = make_request(prompt, max_tokens=2)
    s.kv.ensure_hashes(req, (req.num_tokens - 1) // BS)
    blocks = list(req.block_hashes)
    for swap_ms, expect in ((0.01, "p-host"), (50.0, "p-idle")):
        index = ClusterIndex()
        # p-host holds the prompt in host memory only and is a little busier than p-idle.
        _peer(index, "p-host", blocks, backlog_ms=300.0, swap_ms=swap_ms)
        _peer(index, "p-idle", [], backlog_ms=0.0, swap_ms=swap_ms)
        router = _router(index, {"p-host": "peer", "p-idle": "peer"})
        got = router.route(make_request(prompt, max_tokens=2))
        assert isinstance(got, RemoteInstance) and got.instance_id == expect, (swap_ms, got)


def test_peer_sees_host_hits_over_nats_and_after_a_snapshot(nats_server: NatsServer) -> None:
    async def go() -> None:
        sched, idle = host_sched(), host_sched()
        pub_link = await connect_cluster(nats_server.url, "tier-pub")
        sub_link = await connect_cluster(nats_server.url, "tier-sub")
        pub = KvStream(pub_link, lambda: {"h0": sched, "h1": idle})
        sub = KvStream(sub_link, dict)
        late = KvStream(await connect_cluster(nats_server.url, "tier-late"), dict)
        await pub.start(publish_every_flush_s=False)
        await sub.start(publish_every_flush_s=False)
        try:

            def same(st: KvStream) -> bool:
                v = st.index.instances.get("h0")
                return (
                    v is not None
                    and v.synced
                    and v.hashes == set(keys_of(sched.cached_block_hashes()))
                    and v.host == set(keys_of(sched.host_block_hashes()))
                )

            async def until(st: KvStream) -> None:
                deadline = time.monotonic() + 10
                while not same(st):
                    assert time.monotonic() < deadline, "index did not converge in 10 s"
                    await pub.flush()
                    await asyncio.sleep(0.05)

            ps = prompts(12, seed=5)
            for p in ps:
                serve(sched, p)
            await until(sub)
            v = sub.index.instances["h0"]
            assert v.host - v.hashes, "some blocks are in host memory only"
            # The peer sees each prompt's run split by tier as the instance itself does, and
            # some prompt left the GPU but is still in host memory.
            splits = []
            for p in ps:
                req = make_request(p, max_tokens=2)
                gpu, host = sched.kv.tier_hit_tokens(req)
                assert v.tier_blocks(req.block_hashes) == (gpu // BS, (gpu + host) // BS)
                splits.append((gpu, host))
            assert (0, 3 * BS) in splits, splits
            # The subscriber's router sends a prompt held only in h0's host memory to h0, though
            # h0 is the busier one (a queued prompt) and h1 holds nothing of it: swapping 3
            # blocks in beats recomputing them. Without the host hit h1 would win on load.
            host_only = ps[splits.index((0, 3 * BS))]
            sched.add_request(make_request(100, max_tokens=2))
            deadline = time.monotonic() + 10
            while sub.index.instances["h0"].load.get("waiting", 0.0) < 1:
                assert time.monotonic() < deadline, "h0's load never arrived"
                pub.load_every_s = 0.0
                await pub.flush()
                await asyncio.sleep(0.05)
            router = _router(sub.index, {"h0": pub_link.daemon_id, "h1": pub_link.daemon_id})
            got = router.route(make_request(host_only + [4, 5], max_tokens=2))
            assert isinstance(got, RemoteInstance) and got.instance_id == "h0", got
            # A daemon that starts now gets the host tier through the snapshot.
            await late.start(publish_every_flush_s=False)
            serve(sched, ps[-1] + [1, 2, 3])
            await until(late)
        finally:
            for x in (pub, sub, late):
                await x.stop()
            for link in (pub_link, sub_link, late.link):
                await link.close()

    asyncio.run(go())


def test_a_peers_decode_instance_never_takes_a_new_request() -> None:
    """A decode instance (P/D) takes only prefilled requests: a peer's, though it holds the
    whole prompt and is idle, is never chosen for a new one; its mixed twin is."""
    s = host_sched()
    prompt = prompts(1, seed=11)[0]
    req = make_request(prompt, max_tokens=2)
    s.kv.ensure_hashes(req, (req.num_tokens - 1) // BS)
    blocks = list(req.block_hashes)
    load = {"running": 0.0, "waiting": 0.0, "max_num_seqs": 64.0, "kv_usage": 0.0}
    load |= {"predicted_backlog_ms": 0.0, "prefill_token_ms": 0.05, "attention_ms": 1e-6}
    for role, busy_ms in (("decode", 0.0), ("mixed", 500.0)):
        index = ClusterIndex()
        snap = encode_snapshot("p-cached", "peer", "e", 0, BS, load, blocks, {"role": role})
        index.apply_snapshot(decode(snap), time.monotonic())
        other = load | {"predicted_backlog_ms": busy_ms}
        snap = encode_snapshot("p-other", "peer", "e", 0, BS, other, [])
        index.apply_snapshot(decode(snap), time.monotonic())
        router = _router(index, {"p-cached": "peer", "p-other": "peer"})
        got = router.route(make_request(prompt, max_tokens=2))
        want = "p-other" if role == "decode" else "p-cached"
        assert isinstance(got, RemoteInstance) and got.instance_id == want, (role, got)


def test_a_structured_output_request_goes_only_to_a_peer_that_applies_constraints() -> None:
    """A peer's info says whether its workers apply structured-output constraints (the vLLM
    worker's Hello.structured_outputs): a constrained request goes only to a peer that says
    so, though another holds its prompt and is idle; an unconstrained one takes the cached
    peer; with no peer that applies constraints the peers refuse it naming the field."""
    s = host_sched()
    prompt = prompts(1, seed=13)[0]
    req = make_request(prompt, max_tokens=2)
    s.kv.ensure_hashes(req, (req.num_tokens - 1) // BS)
    blocks = list(req.block_hashes)
    load = {"running": 0.0, "waiting": 0.0, "max_num_seqs": 64.0, "kv_usage": 0.0}
    load |= {"predicted_backlog_ms": 0.0, "prefill_token_ms": 0.05, "attention_ms": 1e-6}
    info = {"model": ServerConfig().model, "max_model_len": 4096}

    def index_of(other_applies: bool) -> ClusterIndex:
        index = ClusterIndex()
        snap = encode_snapshot("p-cached", "peer", "e", 0, BS, load, blocks, info)
        index.apply_snapshot(decode(snap), time.monotonic())
        other = load | {"predicted_backlog_ms": 500.0}
        other_info = info | {"structured_outputs": other_applies}
        snap = encode_snapshot("p-grammar", "peer", "e", 0, BS, other, [], other_info)
        index.apply_snapshot(decode(snap), time.monotonic())
        return index

    owners = {"p-cached": "peer", "p-grammar": "peer"}
    router = _router(index_of(True), owners)
    got = router.route(make_request(prompt, max_tokens=2))
    assert isinstance(got, RemoteInstance) and got.instance_id == "p-cached"
    constrained = make_request(prompt, max_tokens=2)
    constrained.sampling.structured = StructuredOutput("json_object")
    got = router.route(constrained)
    assert isinstance(got, RemoteInstance) and got.instance_id == "p-grammar"
    router = _router(index_of(False), owners)
    with pytest.raises(InvalidRequest, match="structured_output"):
        router.route(constrained)
