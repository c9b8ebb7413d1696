"""How vLLM's shared-memory message queue readers wait, in this process and in vLLM's worker
child: napping instead of spinning.

vLLM's `SpinCondition` (0.32, distributed/device_communicators/shm_broadcast.py) has a reader
spin on `sched_yield` for 1 s after each read, then sleep on a zmq notification. Under vLLM's
own server the spinning processes are the engine's; under kvsched the worker's step thread
(waiting for a step's output) and vLLM's worker child (waiting for the next step) spin while
the daemon and the HTTP front end need the core: on 2 cores, about half of the worker's samples
were `sched_yield`. Waking on the notification alone is no cure: it loses notifications (a step
then waits up to vLLM's 5 s recheck; measured: decode steps of p90 5 s). vLLM has no setting for
either, so the worker replaces the waits of the readers it finds: inside vLLM's 1 s window a
reader sleeps KVSCHED_VLLM_NAP_US microseconds (default 100) between looks instead of yielding;
after it, vLLM's own wait. KVSCHED_VLLM_NAP_US=0 keeps vLLM's spinning.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ENV = "KVSCHED_VLLM_NAP_US"


def nap_seconds() -> float:
    raw = os.environ.get(ENV, "100")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of microseconds, got {raw!r}") from None
    if not 0 <= value <= 100_000:
        raise ValueError(f"{ENV} must be in [0, 100000] microseconds, got {raw!r}")
    return value / 1e6


def _napping_wait(cond: Any, nap_s: float, vllm_wait: Any, timeout_ms: int | None = None) -> None:
    if time.monotonic() <= cond.last_read + cond.busy_loop_s:
        time.sleep(nap_s)
    else:
        vllm_wait(timeout_ms)


def nap_readers(_worker: Any = None, nap_s: float = 1e-4) -> int:
    """Make every local shared-memory reader of this process nap; how many. (Run in vLLM's
    worker child through `collective_rpc`, whose first argument is the worker.)"""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    n = 0
    for obj in gc.get_objects():
        if not (isinstance(obj, MessageQueue) and getattr(obj, "_is_local_reader", False)):
            continue
        cond = getattr(obj, "_spin_condition", None)
        if cond is None or not getattr(cond, "is_reader", False):
            continue
        vllm_wait = getattr(cond.wait, "args", (None, None, cond.wait))[2]  # once only
        cond.wait = functools.partial(_napping_wait, cond, nap_s, vllm_wait)
        n += 1
    return n


def quiet_executor(executor: Any, nap_s: float) -> None:
    """Make the executor's readers nap, here and in its worker processes."""
    if nap_s <= 0:
        return
    here = nap_readers(None, nap_s)
    there = executor.collective_rpc(nap_readers, args=(nap_s,))
    log.info(
        "vLLM shared-memory readers nap %g us between looks (%d here, %s in workers)",
        nap_s * 1e6,
        here,
        there,
    )
