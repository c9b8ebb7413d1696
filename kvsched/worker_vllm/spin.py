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

Napping costs latency: a 100 us nap lasts ~175 us here, and a step waits on a nap's end twice
(its output here, the next step's input in the child). KVSCHED_VLLM_SPIN_BATCH=N (default 0:
off) lets the readers spin as vLLM has them while the last step ran at most N requests, for at
most 5 ms after each read; each process goes by the steps it saw (this one as it sends them, the
child as it runs them: `watch_batches`). Measured (bench.serve_ab tiny, N=2 vs 0, load 3-5,
noisy): concurrency 1 418 vs 300 tok/s, but TTFT p50 40 vs 16 ms, and at concurrency 16 fewer
tokens per step (5.4 vs 9.8): when the control plane lags, batches shrink, the readers spin and
take the core it needs. So it stays off unless asked for.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from typing import Any

from kvsched.worker_vllm import env

log = logging.getLogger(__name__)

ENV = "KVSCHED_VLLM_NAP_US"
SPIN_ENV = "KVSCHED_VLLM_SPIN_BATCH"
# "0": vLLM's worker child keeps vLLM's spinning reader (only this process naps). vLLM's CPU
# build binds the child to its own cores (VLLM_CPU_OMP_THREADS_BIND=auto leaves the others to
# the serving processes). A child that naps ran its forward pass ~2x slower than one that spins
# (session 5, BENCHMARKS 19; pinning the control plane off its core did not change that: the
# idle core between steps is the likelier cause); spinning holds the core, as under vLLM's own
# server, and on 2 cores takes it from the control plane (it lost at 16 and 64 requests).
CHILD_ENV = "KVSCHED_VLLM_CHILD_NAPS"
# This process's last step ran at most the spin batch: its readers spin (vLLM's own wait), for
# at most SPIN_WINDOW_S after their last read (an idle worker's child then naps: spinning for
# vLLM's whole 1 s window took the core the next request's tokenizing and scheduling need).
_small_step = [False]
SPIN_WINDOW_S = 0.005


def nap_seconds() -> float:
    return env.number(ENV, "100", 100_000, "microseconds") / 1e6


def child_naps() -> bool:
    return env.switch(CHILD_ENV, True, "vLLM's worker child naps", "it spins as vLLM has it")


def spin_batch() -> int:
    return int(env.number(SPIN_ENV, "0", 1 << 16, "requests", integer=True))


def note_batch(num_requests: int, limit: int) -> None:
    """A step of `num_requests` requests is under way: spin while it is small (0 < n <= limit)."""
    _small_step[0] = 0 < num_requests <= limit


def watch_batches(worker: Any, limit: int) -> None:
    """In vLLM's worker child (through `collective_rpc`, whose first argument is the worker):
    note each step's batch before it runs."""
    inner = worker.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        note_batch(len(scheduler_output.num_scheduled_tokens), limit)
        return inner(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model


def _napping_wait(cond: Any, nap_s: float, vllm_wait: Any, timeout_ms: int | None = None) -> None:
    if _small_step[0] and time.monotonic() <= cond.last_read + SPIN_WINDOW_S:
        vllm_wait(timeout_ms)  # (inside vLLM's window: sched_yield and look again)
    elif time.monotonic() <= cond.last_read + cond.busy_loop_s:
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


def quiet_executor(executor: Any, nap_s: float, spin_limit: int = 0) -> None:
    """Make the executor's readers nap, here and in its worker processes, except while steps
    run at most `spin_limit` requests (the caller notes its own steps: `note_batch`)."""
    if nap_s <= 0:
        return
    here = nap_readers(None, nap_s)
    there = executor.collective_rpc(nap_readers, args=(nap_s,)) if child_naps() else "none"
    if spin_limit:
        executor.collective_rpc(watch_batches, args=(spin_limit,))
    log.info(
        "vLLM shared-memory readers nap %g us between looks above %d requests a step "
        "(%d here, %s in workers)",
        nap_s * 1e6,
        spin_limit,
        here,
        there,
    )
