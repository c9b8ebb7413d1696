"""Membership and instance leases on a real nats-server: one owner per instance, always."""

from __future__ import annotations

import asyncio
import uuid

from kvsched.cluster.leases import Leases
from kvsched.cluster.link import ClusterLink, connect_cluster
from kvsched.cluster.membership import Membership
from kvsched.cluster.natsd import NatsServer


async def _links(url: str, *ids: str) -> list[ClusterLink]:
    return [await connect_cluster(url, i) for i in ids]


def test_two_daemons_racing_for_instances_exactly_one_wins_each(nats_server: NatsServer) -> None:
    async def go() -> None:
        a, b = await _links(nats_server.url, "race-a", "race-b")
        la, lb = Leases(a), Leases(b)
        await la.start()
        await lb.start()
        try:
            iids = [f"race-{uuid.uuid4().hex[:8]}" for _ in range(40)]
            got = await asyncio.gather(*(x for i in iids for x in (la.acquire(i), lb.acquire(i))))
            for k, iid in enumerate(iids):
                ga, gb = got[2 * k], got[2 * k + 1]
                # Both see the same single winner, and NATS agrees.
                assert ga.owner == gb.owner in ("race-a", "race-b")
                assert (await la.owner(iid)).owner == ga.owner  # type: ignore[union-attr]
            winners = {g.owner for g in got}
            assert winners == {"race-a", "race-b"} or len(winners) == 1
            # Racing takeovers of one lease from its owner: exactly one CAS succeeds.
            iid = iids[0]
            owner = got[0].owner
            c = await connect_cluster(nats_server.url, "race-c")
            lc = Leases(c)
            await lc.start()
            other = lb if owner == "race-a" else la
            oks = await asyncio.gather(other.try_take(iid, owner), lc.try_take(iid, owner))
            assert sorted(oks) == [False, True]
            new_owner = (await la.owner(iid)).owner  # type: ignore[union-attr]
            assert new_owner == ("race-c" if oks[1] else other.daemon_id)
            # A stale take (from the old owner) fails now.
            assert not await la.try_take(iid, owner) or owner == new_owner
            await lc.stop()
            await c.close()
        finally:
            await la.stop()
            await lb.stop()
            await a.close()
            await b.close()

    asyncio.run(go())


def test_release_and_take_from_nobody(nats_server: NatsServer) -> None:
    async def go() -> None:
        a, b = await _links(nats_server.url, "rel-a", "rel-b")
        la, lb = Leases(a), Leases(b)
        await la.start()
        await lb.start()
        try:
            iid = f"rel-{uuid.uuid4().hex[:8]}"
            assert (await la.acquire(iid)).owner == "rel-a"
            assert not await lb.release(iid)  # not b's to release
            assert not await lb.try_take(iid, None)  # owned: not "from nobody"
            assert await la.release(iid)
            assert await la.owner(iid) is None
            assert await lb.try_take(iid, None)
            assert (await lb.acquire(iid)).owner == "rel-b"
            # The watcher of the other side catches up.
            for _ in range(100):
                if la.cached_owner(iid) == "rel-b":
                    break
                await asyncio.sleep(0.02)
            assert la.cached_owner(iid) == "rel-b"
        finally:
            await la.stop()
            await lb.stop()
            await a.close()
            await b.close()

    asyncio.run(go())


def test_membership_sees_joins_graceful_leaves_and_expiry(nats_server: NatsServer) -> None:
    async def go() -> None:
        a, b, c = await _links(nats_server.url, "mem-a", "mem-b", "mem-c")
        # One bucket per server: every test in this module shares it, so give it a short TTL
        # from the first user on.
        ma = Membership(
            a, "127.0.0.1:1", ttl_s=1.2, summary=lambda: (["i0"], {"i0": {"running": 2.0}})
        )
        mb = Membership(b, "127.0.0.1:2", ttl_s=1.2)
        mc = Membership(c, "127.0.0.1:3", ttl_s=1.2)
        for m in (ma, mb, mc):
            await m.start()
        q = ma.departures()
        try:
            await ma.refresh()
            assert {"mem-a", "mem-b", "mem-c"} <= set(ma.members)
            assert ma.members["mem-a"].instances == ["i0"]
            assert ma.members["mem-a"].load["i0"]["running"] == 2.0
            assert ma.members["mem-b"].address == "127.0.0.1:2"
            await mb.stop()  # graceful
            dep = await asyncio.wait_for(q.get(), 10)
            assert (dep.daemon_id, dep.graceful) == ("mem-b", True)
            # c dies: it stops refreshing without a word; its entry expires.
            # Its NATS connection goes with it: cancelling its refresh task alone is not
            # enough (a nats-py call can swallow the cancellation and the loop runs on).
            assert mc._task is not None
            mc._task.cancel()
            await c.close()
            dep = await asyncio.wait_for(q.get(), 15)
            assert (dep.daemon_id, dep.graceful) == ("mem-c", False)
            assert not ma.alive("mem-c") and ma.alive("mem-a")
        finally:
            await ma.stop()
            for link in (a, b, c):
                await link.close()

    asyncio.run(go())
