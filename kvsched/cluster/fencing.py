"""Fencing on the daemon's side (protocol step 12): an instance attached here whose lease a
live daemon now holds under a larger epoch is handed to that daemon.

    n = hand_over_fenced(engines, leases, members)   # every view pass of ClusterNode (0.2 s):
                                                     # cached reads only; n instances handed

The epoch itself is the lease's revision (`Leases.epoch`); the registry stamps it on the
instance's Welcome and Tasks (`InstanceEngine.fencing_epoch`), and the worker refuses a lower
one (kvsched/worker_stub/guard.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvsched.cluster.leases import Leases
from kvsched.v1 import worker_service_pb2 as wpb

log = logging.getLogger("kvsched.cluster")


def hand_over_fenced(engines: Mapping[str, Any], leases: Leases, members: Mapping[str, Any]) -> int:
    """Attached instances whose lease a live daemon holds under a larger epoch (it took the
    lease by CAS): redirect their workers to that daemon and take the instance out here
    (its requests move to this daemon's other instances). Never driven again under the old
    epoch: the worker, once welcomed by the new owner, refuses it anyway (step 12)."""
    handed = 0
    for iid, eng in list(engines.items()):
        if not eng.ranks:
            continue
        lease = leases.cached(iid)
        if lease is None or lease.owner == leases.daemon_id:
            continue
        if lease.revision <= eng.fencing_epoch:
            continue
        member = members.get(lease.owner)
        if member is None:  # the holder is not live: the takeover scan moves its leases
            continue
        address = member.address
        redirect = wpb.ConnectResponse(
            redirect=wpb.Redirect(
                address=address,
                owner_daemon_id=lease.owner,
                reason=(
                    f"instance {iid} was taken by daemon {lease.owner} (epoch "
                    f"{lease.revision} > {eng.fencing_epoch})"
                ),
            )
        ).SerializeToString()
        for conn in eng.ranks.values():
            if not conn.closed:
                conn.queue.put_nowait(redirect)
        handed += 1
        log.warning(
            "lease of instance %s taken by daemon %s (epoch %d > %d): its workers are sent there",
            iid,
            lease.owner,
            lease.revision,
            eng.fencing_epoch,
        )
        eng.take_out(f"lease taken by daemon {lease.owner}", worker_fault=False)
    return handed
