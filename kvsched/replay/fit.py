"""Which requests of a trace no ready instance can hold: said before a replay starts, so that
the daemon's refusals that follow are expected (and the fix is named)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvsched.traces import TraceRequest
from kvsched.v1 import admin_service_pb2 as apb


def unfit(requests: Sequence[TraceRequest], status: apb.GetStatusResponse) -> list[tuple[str, int]]:
    """The requests whose prompt needs more KV blocks than the largest ready instance has
    (`trace-i`, blocks needed), in the daemon's own terms: ceil(prompt tokens / block size)."""
    ready = [i for i in status.instances if i.ready and i.block_size > 0]
    if not ready:
        return []
    best = max(ready, key=lambda i: i.num_gpu_blocks * i.block_size)
    out = []
    for k, r in enumerate(requests):
        need = -(-len(r.prompt_token_ids) // best.block_size)
        if need > best.num_gpu_blocks:
            out.append((f"trace-{k}", need))
    return out


def warn_unfit(rows: Sequence[tuple[str, int]], status: apb.GetStatusResponse) -> None:
    if not rows:
        return
    ready = [i for i in status.instances if i.ready and i.block_size > 0]
    best = max(ready, key=lambda i: i.num_gpu_blocks * i.block_size)
    shown = ", ".join(f"{rid} ({need:,} blocks)" for rid, need in rows[:10])
    more = f" and {len(rows) - 10} more" if len(rows) > 10 else ""
    print(
        f"kvsched replay: {len(rows)} request(s) of the trace need more KV blocks than the "
        f"largest ready instance ({best.instance_id}: {best.num_gpu_blocks:,} blocks of "
        f"{best.block_size} tokens); the daemon will refuse them: {shown}{more}. Give the "
        f"workers more blocks (kvsched worker --num-blocks N --block-size B) to replay them.",
        file=sys.stderr,
    )
