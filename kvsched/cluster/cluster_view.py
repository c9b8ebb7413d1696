"""The cluster as one daemon sees it, and the probe that proves a peer dead.

cluster_status(node)              AdminService.GetStatus's `cluster` (ClusterNode's view)
await refuses_connections(addr)   True: nothing listens there (a death, not a pause)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any, Protocol

from kvsched.v1 import admin_service_pb2 as apb


class _Node(Protocol):  # what is read of kvsched.cluster.node.ClusterNode
    daemon_id: str
    stream: Any
    router: Any
    membership: Any
    leases: Any

    @property
    def connected(self) -> bool: ...


async def refuses_connections(address: str, timeout_s: float = 0.5) -> bool:
    """True when nothing listens at `address` (the connection is refused): proof that the
    daemon that advertised it is dead. A timeout or any other error proves nothing (a paused
    or partitioned daemon): False."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::") or address.startswith("unix:"):
        return False  # a wildcard (no --advertise) names no one host: it proves nothing
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, TimeoutError):
        return False
    writer.close()
    return False


def cluster_status(node: _Node) -> apb.ClusterStatus:
    """The cluster as `node` sees it (AdminService.GetStatus)."""
    index, router = node.stream.index, node.router
    out = apb.ClusterStatus(
        daemon_id=node.daemon_id,
        connected=node.connected,
        num_routed_local=router.num_local,
        num_forwarded=router.num_forwarded,
        num_prefix_routed=router.num_prefix_routed,
        num_event_gaps=index.num_gaps,
        num_snapshots=index.num_snapshots,
    )
    out.route_us_p50, out.route_us_p99 = router.route_percentiles_us()
    for did, m in sorted(node.membership.members.items()):
        out.daemons.append(
            apb.ClusterStatus.Daemon(daemon_id=did, address=m.address, instances=m.instances)
        )
    owners = {i: lease.owner for i, lease in node.leases.owners().items()}
    now = time.monotonic()
    for iid in sorted(set(owners) | set(index.instances)):
        st = apb.ClusterStatus.Instance(instance_id=iid, owner_daemon_id=owners.get(iid, ""))
        v = index.instances.get(iid)
        if v is not None and v.synced:
            ld = v.load
            st.load_known = bool(ld) and now - v.heard <= router.stale_s
            st.num_running = ld.get("running", 0.0)
            st.num_waiting = ld.get("waiting", 0.0)
            st.kv_cache_usage = ld.get("kv_usage", 0.0)
            st.queued_prefill_tokens = ld.get("queued_prefill_tokens", 0.0)
            st.num_indexed_blocks = len(v.hashes)
            st.events_seq = v.seq
            st.index_digest = hash_digest(v.hashes)
        out.instances.append(st)
    return out


def hash_digest(hashes: Collection[int]) -> str:
    """A short digest of an instance's indexed hash keys (`hit_index.key64`, themselves
    uniform 64-bit hashes): their count and their sum mod 2**64, which needs no sort (sorting
    and hashing 46k keys took ~52 ms of a GetStatus; the sum ~1 ms). Two daemons whose
    indexes of an instance agree show the same digest; a differing key changes it but for a
    chance of 2**-64."""
    return f"{len(hashes):x}-{sum(hashes) & 0xFFFFFFFFFFFFFFFF:016x}"
