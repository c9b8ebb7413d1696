"""A deterministic discrete-event simulation of kvsched serving a trace, in virtual time.

No sleeping, no gRPC: trace arrivals go through `kvsched.core.Router` to one `Scheduler` per
instance, whose `Tasks` drive a real `WorkerEngine` over a `SimExecutor`; the cost model gives
each step's duration and the virtual clock jumps from event to event. The asynchronous worker
worker protocol (protos/kvsched/v1/worker_service.proto) is kept, so tasks planned after report n reach step n + 2:

    worker   |---- step n ----|---- step n+1 ----|---- step n+2 ----|
                              ^ report n          ^ boundary: applies every Tasks received
    daemon                    apply_report(n), schedule() --Tasks (+ control_latency_s)--^

At a step boundary the worker first starts its next step with what it holds, then the daemon
sees the report; a worker with nothing runnable waits, and starts the moment Tasks arrive.
A new arrival also wakes its instance's daemon loop (one schedule(), as the server does).

The scheduler's CPU time is measured for real (perf_counter_ns around apply_report() and
schedule()) while the virtual clock advances only by the cost model, so the results are
reproducible and the CPU figures say what the daemon would spend per step.

    result = simulate(trace_requests, KvschedCluster.factory(config, num_instances=3))
    print(result.summary(slo_ttft_s=5, slo_tpot_s=0.1))
"""

from __future__ import annotations

import copy
import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from bench.sim_result import InstanceStats, SimResult
from kvsched.core import (
    EngineConfig,
    Events,
    InvalidRequest,
    Request,
    Router,
    SamplingParams,
    Scheduler,
    StepReport,
    StorageIndex,
    Tasks,
)
from kvsched.core.errors import CapacityExceeded
from kvsched.replay.summary import (
    RequestRecord,
)
from kvsched.traces import TraceRequest
from kvsched.worker_stub.costmodel import KV_BYTES_PER_TOKEN, fit_for, step_time_s
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.executor import SeqWork, StepResult
from kvsched.worker_stub.sim import SimExecutor, _split_work

VOCAB_SIZE = 32000  # the traces' token ids (kvsched.traces.load_trace default)
EOS_TOKEN_ID = 2  # the sim never samples it unless asked (eos_every): outputs run to max_tokens


class EventLoop:
    """Virtual time: callbacks run in (time, insertion) order; `now` jumps between them."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        if t < self.now:
            raise ValueError(f"event at {t} is in the past (now {self.now})")
        heapq.heappush(self._heap, (t, self._seq, fn, args))
        self._seq += 1

    def run(self, until: float | None = None) -> None:
        """Run events in order until none is left (or the next one is after `until`)."""
        heap = self._heap
        while heap and (until is None or heap[0][0] <= until):
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)


class MeteredSim(SimExecutor):
    """The sim executor, also recording what each executed step held (`InstanceStats`)."""

    def __init__(self, stats: InstanceStats, **kw: Any) -> None:
        super().__init__(**kw)
        self._stats = stats

    def execute(self, work: list[SeqWork]) -> StepResult:
        result = super().execute(work)
        chunks, _, _ = _split_work(work)
        self._stats.prefill_tokens.append(sum(c for c, _ in chunks))
        self._stats.step_s.append(result.step_time_s)
        return result


class Instance(Protocol):
    stats: InstanceStats


class Cluster(Protocol):
    """N instances of one scheduler under test, and how a new request is routed to one."""

    name: str
    num_gpu_blocks: int  # per instance
    block_size: int
    router_ns: list[int]  # real CPU of each routing decision

    @property
    def instances(self) -> Sequence[Instance]: ...

    def submit(self, tr: TraceRequest, rec: RequestRecord) -> None:
        """A request arrives now: route it and queue it (or mark rec rejected)."""
        ...


ClusterFactory = Callable[[EventLoop], Cluster]


def record_tokens(rec: RequestRecord, num_output_tokens: int, now: float) -> None:
    """Stamp the tokens a request gained (its output count is now num_output_tokens)."""
    if rec.first_token_s is None and num_output_tokens > 0:
        rec.first_token_s = now
    times = rec.token_times_s
    times.extend([now] * (num_output_tokens - len(times)))


# ==== kvsched =================================================================================
class KvschedInstance:
    """One instance: a Scheduler (the daemon's side) and a WorkerEngine + SimExecutor."""

    def __init__(
        self,
        loop: EventLoop,
        config: EngineConfig,
        gpu: str,
        control_latency_s: float,
        index: int,
        check: bool = False,
        storage: StorageIndex | None = None,
        storage_gbps: float | None = None,
    ) -> None:
        self.loop = loop
        self.sched = Scheduler(
            config,
            clock=lambda: loop.now,
            instance_id=f"sim-{index}",
            storage=storage,  # the daemon's one storage index (shared by its instances)
            storage_namespace="sim",
        )
        cc, sc = config.cache, config.scheduler
        self.stats = InstanceStats()
        executor = MeteredSim(
            self.stats,
            gpu=gpu,
            vocab_size=VOCAB_SIZE,
            eos_token_id=EOS_TOKEN_ID,
            block_bytes=KV_BYTES_PER_TOKEN * cc.block_size,  # host tier copies over PCIe
            **({"storage_gbps": storage_gbps} if storage_gbps else {}),  # storage transfers
        )
        self.worker = WorkerEngine(
            executor,
            cc.block_size,
            sc.max_num_seqs,
            EOS_TOKEN_ID,
            sc.max_model_len,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
        )
        self.control_latency_s = control_latency_s
        self.check = check
        self._inbox: list[Tasks] = []
        self._busy = False
        self._idle_since: float | None = None  # None: never ran yet

    def add(self, req: Request) -> bool:
        """Queue a new request and run one daemon step; False if the scheduler rejects it."""
        try:
            self.sched.add_request(req)
        except InvalidRequest:
            return False
        self._daemon_step(None)
        return True

    # ---- daemon side ------------------------------------------------------------------------
    def _daemon_step(self, report: StepReport | None) -> None:
        """What the server's engine loop does on a wake: fold in the report, schedule once."""
        sched, pc = self.sched, time.perf_counter_ns
        t0 = pc()
        events = sched.apply_report(report) if report is not None else None
        t1 = pc()
        if events is not None:
            self._on_events(events)
        t2 = pc()
        tasks = sched.schedule()
        t3 = pc()
        self.stats.sched_ns.append(t1 - t0 + t3 - t2)
        self._on_events(sched.take_events())
        if self.check:
            sched.check_integrity()
        if not tasks.is_empty():
            now = self.loop.now
            self.loop.at(now + self.control_latency_s, self._deliver, tasks, now)

    def _on_events(self, ev: Events) -> None:
        now = self.loop.now
        for req in ev.token_reqs:
            record_tokens(req.tag, req.num_output_tokens, now)  # type: ignore[arg-type]
        for req in ev.finished:
            rec: RequestRecord = req.tag  # type: ignore[assignment]
            record_tokens(rec, req.num_output_tokens, now)
            rec.finish_s = now
            rec.finish_reason = req.finish_reason.name.lower()
            rec.num_cached_tokens = max(0, req.num_cached_tokens)
            rec.num_preemptions = req.num_preemptions
        self.stats.num_preemptions = self.sched.stats.num_preemptions

    # ---- worker side ------------------------------------------------------------------------
    def _deliver(self, tasks: Tasks, made_s: float) -> None:
        self._inbox.append(tasks)
        if not self._busy:
            self._boundary(made_s)

    def _boundary(self, made_s: float | None) -> None:
        """A step boundary: apply every Tasks received, run one step if anything is runnable."""
        for tasks in self._inbox:
            self.worker.apply(tasks)
        self._inbox.clear()
        report = self.worker.step()
        now = self.loop.now
        if report is None:
            self._busy = False
            return
        if self._idle_since is not None and now > self._idle_since:
            self.stats.idle_s += now - self._idle_since
            if made_s is not None:
                self.stats.idle_control_plane_s += now - max(self._idle_since, made_s)
        self._busy = True
        dt = report.step_time_ns / 1e9
        self.stats.busy_s += dt
        self.loop.at(now + dt, self._step_end, report)

    def _step_end(self, report: StepReport) -> None:
        self.stats.num_steps += 1
        self._busy = False
        self._idle_since = self.loop.now
        self._boundary(None)  # the worker goes on at once with what it holds ...
        self._daemon_step(report)  # ... and the daemon's answer lands a step later


class KvschedCluster:
    """kvsched's core on N instances behind `kvsched.core.Router`."""

    def __init__(
        self,
        loop: EventLoop,
        config: EngineConfig,
        num_instances: int = 1,
        gpu: str = "h100",
        control_latency_s: float = 0.0,
        name: str = "kvsched",
        check: bool = False,
        tenant_of: Callable[[RequestRecord], str] | None = None,
        storage: bool = False,
        storage_gbps: float | None = None,
    ) -> None:
        """storage: a shared storage tier behind every instance (one StorageIndex, as one
        daemon has; the sim workers simulate the store, priced by size and bandwidth)."""
        config = copy.deepcopy(config).validate()
        self.name = name
        self.tenant_of = tenant_of  # each request's tenant (bench.tenants); None: all ""
        self.loop = loop
        self.num_gpu_blocks = config.cache.num_gpu_blocks
        self.block_size = config.cache.block_size
        self.router = Router()
        index = StorageIndex() if storage else None
        self.instances = [
            KvschedInstance(
                loop, copy.deepcopy(config), gpu, control_latency_s, i, check, index, storage_gbps
            )
            for i in range(num_instances)
        ]
        self._scheds = [inst.sched for inst in self.instances]
        self.router_ns: list[int] = []

    @classmethod
    def factory(cls, config: EngineConfig, **kw: Any) -> ClusterFactory:
        return lambda loop: cls(loop, config, **kw)

    def submit(self, tr: TraceRequest, rec: RequestRecord) -> None:
        req = Request(
            rec.req_id,
            tr.prompt_token_ids,
            SamplingParams(max_tokens=tr.max_tokens),
            arrival_time=self.loop.now,
            tenant=self.tenant_of(rec) if self.tenant_of is not None else "",
        )
        req.tag = rec
        t0 = time.perf_counter_ns()
        try:
            index = self.router.pick(self._scheds, req) if len(self._scheds) > 1 else 0
        except CapacityExceeded:  # refused by the router (overload "refuse"): told at once
            rec.finish_reason = "rejected"
            return
        finally:
            self.router_ns.append(time.perf_counter_ns() - t0)
        rec.instance = index
        if not self.instances[index].add(req):
            rec.finish_reason = "rejected"


# ==== the run =================================================================================
def simulate(
    requests: Sequence[TraceRequest],
    make_cluster: ClusterFactory,
    rate_scale: float = 1.0,
    until_s: float | None = None,
) -> SimResult:
    """Serve `requests` (arrivals divided by rate_scale) until every one has finished, or until
    virtual time `until_s` (then the unfinished ones stay unfinished)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    loop = EventLoop()
    cluster = make_cluster(loop)
    records = [
        RequestRecord(f"r{i}", tr.arrival_s / rate_scale, len(tr.prompt_token_ids), tr.max_tokens)
        for i, tr in enumerate(requests)
    ]
    for tr, rec in zip(requests, records, strict=True):
        loop.at(rec.arrival_s, cluster.submit, tr, rec)
    t0 = time.perf_counter()
    loop.run(until=until_s)
    for inst in cluster.instances:
        cost = getattr(getattr(inst, "sched", None), "cost", None)  # kvsched's step-cost model
        if cost is not None:
            inst.stats.cost_model = {
                "coefficients_ms": list(cost.coefficients),
                "ewma_predicted_ms": cost.ewma_predicted_ms,
                "ewma_measured_ms": cost.ewma_measured_ms,
                "steps_learned": cost.num_observed,
            }
        sched = getattr(inst, "sched", None)
        kv = getattr(sched, "kv", None)  # None for vLLM's scheduler (bench.vllm_adapter)
        if sched is not None and kv is not None and kv.host is not None:  # the host KV tier
            snap = sched.snapshot()
            inst.stats.host = {
                "num_host_blocks": snap.num_host_blocks,
                "query_tokens": snap.prefix_cache_query_tokens,
                "hit_tokens": snap.prefix_cache_hit_tokens,
                "host_hit_tokens": snap.prefix_cache_host_hit_tokens,
                "swap_outs": snap.num_swap_outs,
                "swap_ins": snap.num_swap_ins,
                "swap_ins_declined": snap.num_swap_ins_declined,
            }
        if sched is not None and kv is not None and getattr(kv, "storage", None) is not None:
            snap = sched.snapshot()
            inst.stats.storage = {
                "storage_hit_tokens": snap.prefix_cache_storage_hit_tokens,
                "writes": snap.num_storage_writes,
                "fetches": snap.num_storage_fetches,
                "write_failures": snap.num_storage_write_failures,
                "fetch_failures": snap.num_storage_fetch_failures,
                "fetches_declined": snap.num_storage_fetches_declined,
            }
    return SimResult(
        name=cluster.name,
        records=records,
        instances=[inst.stats for inst in cluster.instances],
        num_gpu_blocks=cluster.num_gpu_blocks,
        block_size=cluster.block_size,
        router_ns=cluster.router_ns,
        wall_s=time.perf_counter() - t0,
    )


def offered_work_s(requests: Sequence[TraceRequest], gpu: str = "h100", chunk: int = 8192) -> float:
    """GPU-seconds of work in `requests` by the cost model, with no prefix hits: every prompt
    prefilled alone in `chunk`-token chunks, every decode token at its weight share plus its
    attention over the context (perfect batching: the step floor is not charged). Divided by
    (instances x span) it estimates utilisation."""
    fit = fit_for(gpu)
    work_ms = 0.0
    for tr in requests:
        n = len(tr.prompt_token_ids)
        for start in range(0, n, chunk):
            work_ms += 1e3 * step_time_s(gpu, [(min(chunk, n - start), start)], [])
        # decode i (1..max_tokens-1) attends over n + i positions
        m = tr.max_tokens - 1
        work_ms += m * fit.per_token_ms + fit.per_ctx_ms * (m * n + m * (m + 1) / 2)
    return work_ms / 1e3
