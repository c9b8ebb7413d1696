"""Prometheus metrics, named after vLLM's (`vllm:x` is `kvsched_x` here), labelled by `instance`
and `model`, in a registry of their own per daemon.

Nothing here runs per token, and no prometheus_client object sits on the hot path:

- gauges and the scheduler's own counters (instance ready / accepting, requests running /
  waiting, KV usage, free blocks, prefix-cache queries and hits, preemptions, prompt and
  generation tokens) are read when /metrics is scraped, from the `InstanceFacts` values each
  instance publishes (telemetry/values.py; the registry builds them, `read_facts_from`);
- the hooks bump plain ints and `Hist` buckets (a bisect and two adds), per request at first
  token and at finish, per worker report, per schedule() call, from the values they are
  handed (`StepStats`, `InstanceInfo`): nothing here calls into an engine or the daemon.

Definitions that differ from a naive reading:

- prompt tokens count when a request is first placed; generation tokens are the tokens the core
  accepted (a worker's extra tokens past max_tokens, or about a previous slot occupant, are not).
- `inter_token_latency_seconds`: per worker report, the time since the instance's previous
  report, observed once per decode token the report delivered (first tokens excluded: they are
  TTFT). That is the gap a streaming client sees between two tokens of a request, weighted per
  token as vLLM's per-token histogram, at O(1) per report.
- `time_per_output_token_seconds`: per finished request, (finish - first token) / (outputs - 1).
- Latency histograms (e2e, queue, time per output token) take requests that ended STOP or
  LENGTH; aborted and failed requests only count in `request_success_total{finished_reason}`.
  TTFT is observed when the first token arrives.
- Counters survive a worker reconnect (a new scheduler per instance): the old scheduler's final
  totals are folded into a per-instance base, so they never go backwards.

The HTTP endpoint runs on the daemon's event loop (asyncio.start_server): no thread reads core
state while the engine loop changes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder

from kvsched.core import FinishReason, Unavailable
from kvsched.core.scheduler import SNAPSHOT_COUNTERS
from kvsched.server.config.settings import split_host_port
from kvsched.server.telemetry.gauges import (
    cluster_families,
    host_tier_families,
    lora_families,
    step_cost_families,
)
from kvsched.server.telemetry.histograms import (
    BATCH_BUCKETS,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
    STEP_BUCKETS,
    TTFT_BUCKETS,
    Hist,
)
from kvsched.server.telemetry.refusals import Refusals
from kvsched.server.telemetry.tenants import TenantMetrics
from kvsched.server.telemetry.values import ClusterFacts, InstanceFacts, InstanceInfo, StepStats

log = logging.getLogger("kvsched.metrics")

# Scheduler counters read at scrape time, in this order (see _Totals).
_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in tokens (prompt + output at placement)."),
    ("prefix_cache_hits", "Prefix cache hits, in tokens."),
    ("num_preemptions", "Requests preempted (recompute)."),
    ("prompt_tokens", "Prompt tokens of requests placed on a worker."),
    ("generation_tokens", "Output tokens accepted from workers."),
    ("prefix_cache_host_hits", "Prefix cache hits swapped in from the host tier, in tokens."),
    ("kv_swap_out_blocks", "KV blocks copied GPU -> host tier."),
    ("kv_swap_in_blocks", "KV blocks copied host tier -> GPU."),
    ("prefix_cache_storage_hits", "Prefix cache hits fetched from the storage tier, in tokens."),
    ("kv_storage_write_blocks", "KV blocks written to the shared storage tier (sent)."),
    ("kv_storage_fetch_blocks", "KV blocks fetched from the shared storage tier (sent)."),
    ("kv_storage_write_failures", "Storage tier writes the worker failed (never counted stored)."),
    (
        "kv_storage_fetch_failures",
        "Storage tier fetches the worker failed (the request recomputed).",
    ),
    ("kv_storage_fetches_declined", "Storage hits recomputed instead (cheaper by the cost model)."),
    ("kv_storage_prefetch_blocks", "KV blocks prefetched storage -> host for queued requests."),
    ("kv_storage_prefetch_failures", "Storage -> host prefetches the worker failed."),
    (
        "prefix_cache_prefetched_hits",
        "Storage hits prefetched into the host tier before placement (swapped in), in tokens.",
    ),
    ("encoder_cache_hits", "Multimodal items whose encoder output the worker already held."),
    ("encoder_cache_misses", "Multimodal items the worker had to encode."),
    ("spec_decode_num_draft_tokens", "Speculative draft tokens the worker verified."),
    ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
    (
        "steps_over_itl_target",
        "Worker steps with decodes whose measured time passed the ITL target.",
    ),
)


# attribute of InstanceMetrics -> (metric name without the kvsched_ prefix, help text)
_HISTS = {
    "ttft": ("time_to_first_token_seconds", "Time from arrival to the first output token."),
    "itl": (
        "inter_token_latency_seconds",
        "Time between consecutive output tokens of a request (per worker report, per token).",
    ),
    "tpot": (
        "time_per_output_token_seconds",
        "Per request: (finish - first token) / (output tokens - 1).",
    ),
    "e2e": ("e2e_request_latency_seconds", "Arrival to finish, requests ending STOP or LENGTH."),
    "queue": ("request_queue_time_seconds", "Arrival to first placement on a worker."),
    "step": ("scheduler_step_seconds", "Duration of one schedule() call."),
    "batch": ("batch_size", "Requests run in one worker step (per report)."),
    "spec": (
        "request_spec_decode_acceptance_rate",
        "Per finished request that verified speculative drafts: accepted / verified drafts.",
    ),
}


class InstanceMetrics:
    """One instance's hook-fed numbers, and the engine epoch they follow."""

    __slots__ = (
        "batch",
        "e2e",
        "epoch",
        "finished",
        "itl",
        "last_gen",
        "last_report",
        "pending_first",
        "queue",
        "spec",
        "step",
        "tpot",
        "ttft",
    )

    def __init__(self) -> None:
        self.ttft = Hist(TTFT_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)
        self.tpot = Hist(ITL_BUCKETS)
        self.e2e = Hist(LATENCY_BUCKETS)
        self.queue = Hist(LATENCY_BUCKETS)
        self.step = Hist(STEP_BUCKETS)
        self.batch = Hist(BATCH_BUCKETS)
        self.spec = Hist(RATIO_BUCKETS)
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.epoch = 0  # the engine's epoch (its scheduler) the fields below follow
        self.last_gen = 0  # the engine's generation_tokens at the last report
        self.last_report = 0.0  # monotonic time of the last report (0: none yet)
        self.pending_first = 0  # first tokens among the tokens of the report being applied

    def follow(self, epoch: int, generation_tokens: int) -> None:
        """The engine's scheduler was replaced (a new epoch): its counters restart."""
        self.epoch = epoch
        self.last_gen = generation_tokens
        self.last_report = 0.0
        self.pending_first = 0


def _no_instances() -> Mapping[str, InstanceFacts]:
    return {}


def _no_cluster() -> ClusterFacts | None:
    return None


class Metrics:
    """The daemon's metrics: hooks called by `Observability`, scraped through `registry`."""

    def __init__(self, model: str) -> None:
        self.model = model
        # Scrape-time sources, handed in by the composition root (Telemetry.read_facts_from).
        self.instance_facts: Callable[[], Mapping[str, InstanceFacts]] = _no_instances
        self.cluster_facts: Callable[[], ClusterFacts | None] = _no_cluster
        self.instances: dict[str, InstanceMetrics] = {}
        self.tenants = TenantMetrics(lambda: Hist(TTFT_BUCKETS))
        self.refusals = Refusals()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._server: asyncio.AbstractServer | None = None

    def instance(self, instance_id: str) -> InstanceMetrics:
        m = self.instances.get(instance_id)
        if m is None:
            m = self.instances[instance_id] = InstanceMetrics()
        return m

    # ---- hooks ------------------------------------------------------------------------------
    def lifecycle(self, instance: InstanceInfo, events: Any) -> None:
        first = events.first_token
        if not first:
            return
        m = self.instance(instance.instance_id)
        m.pending_first += len(first)
        for req in first:
            m.ttft.observe(max(0.0, req.first_token_time - req.arrival_time))
        self.tenants.first_tokens(instance, first)

    def report_applied(self, step: StepStats) -> None:
        m = self.instance(step.instance_id)
        epoch = step.epoch
        if not epoch:
            return
        gen = step.generation_tokens
        if epoch != m.epoch:
            m.follow(epoch, gen)
        now = time.monotonic()
        decode = gen - m.last_gen - m.pending_first
        m.last_gen, m.pending_first = gen, 0
        if decode > 0 and m.last_report > 0.0:
            m.itl.observe(now - m.last_report, decode)
        m.last_report = now
        m.batch.observe(step.batch)

    def request_finished(self, tr: Any) -> None:
        req = tr.req
        m = self.instance(tr.instance_id)
        reason = req.finish_reason
        name = reason.name.lower()
        m.finished[name] = m.finished.get(name, 0) + 1
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        t0, end = req.arrival_time, req.finished_time
        m.e2e.observe(max(0.0, end - t0))
        if req.first_scheduled_time >= 0:
            m.queue.observe(max(0.0, req.first_scheduled_time - t0))
        n = len(req.output_token_ids)
        if n > 1 and req.first_token_time >= 0:
            m.tpot.observe(max(0.0, end - req.first_token_time) / (n - 1))
        if req.num_draft_tokens:
            m.spec.observe(req.num_accepted_drafts / req.num_draft_tokens)

    def scheduler_step(self, step: StepStats) -> None:
        m = self.instance(step.instance_id)
        m.step.observe(step.seconds)
        if step.epoch and step.epoch != m.epoch:
            m.follow(step.epoch, step.generation_tokens)  # every scheduler, before it counts

    # ---- HTTP -------------------------------------------------------------------------------
    async def start_server(self, listen: str) -> int:
        """Serve /metrics on `listen` (HOST:PORT, port 0 picks one) on the running loop;
        returns the bound port. Unavailable when the address cannot be bound."""
        host, port = split_host_port(listen)
        try:
            self._server = await asyncio.start_server(self._handle, host, port)
        except OSError as exc:
            raise Unavailable(
                f"cannot serve metrics on {listen}: {exc.strerror or exc}; choose another "
                "--metrics-listen address, or `off`"
            ) from None
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("serving /metrics on %s:%d", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            status, ctype, body = self._respond(head.decode("latin-1"))
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if not head.startswith(b"HEAD "):
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a client that hung up or sent garbage: nothing to answer
        finally:
            writer.close()

    def _respond(self, head: str) -> tuple[str, str, bytes]:
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request line\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        if target not in ("/metrics", "/"):
            return "404 Not Found", "text/plain", b"kvsched serves /metrics\n"
        accept = ""
        for line in lines[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == "accept":
                accept = value.strip()
        encoder, ctype = choose_encoder(accept)
        return "200 OK", ctype, encoder(self.registry)


def served_model(facts: Mapping[str, InstanceFacts], configured: str) -> str:
    """The model label of daemon-wide families: the one model the instances announced
    (Hello.model), else the configured `model`."""
    got = {f.model or configured for f in facts.values()}
    return got.pop() if len(got) == 1 else configured


class _Collector:
    """Builds every kvsched_* family at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        mx = self.metrics
        facts = mx.instance_facts()
        model = served_model(facts, mx.model)
        labels = ["instance", "model"]
        gauges = {
            "running": GaugeMetricFamily(
                "kvsched_num_requests_running", "Requests placed on a worker slot.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "kvsched_num_requests_waiting", "Requests in the waiting queue.", labels=labels
            ),
            "usage": GaugeMetricFamily(
                "kvsched_kv_cache_usage_perc",
                "Fraction of KV blocks in use (0-1; free cached blocks count as free).",
                labels=labels,
            ),
            "free": GaugeMetricFamily(
                "kvsched_num_free_blocks", "KV blocks free (cached or empty).", labels=labels
            ),
        }
        counters = [
            CounterMetricFamily(f"kvsched_{name}", doc, labels=labels) for name, doc in _COUNTERS
        ]
        ready = GaugeMetricFamily(
            "kvsched_instance_ready",
            "1 while the instance has all its worker ranks connected, 0 once a worker is lost "
            "(or before the first connects).",
            labels=labels,
        )
        accepting = GaugeMetricFamily(
            "kvsched_instance_accepting",
            "1 while the instance takes new requests: ready, neither paused nor draining.",
            labels=labels,
        )
        for iid, f in facts.items():
            # Every known instance, connected or not: an alert on a lost worker needs the 0.
            im = f.model or mx.model
            ready.add_metric([iid, im], 1 if f.ready else 0)
            accepting.add_metric([iid, im], 1 if f.accepting else 0)
            snap = f.snapshot
            if snap is None:
                continue
            m = mx.instance(iid)
            if f.epoch != m.epoch:
                m.follow(f.epoch, f.generation_tokens)
            lv = [iid, im]
            gauges["running"].add_metric(lv, snap.num_running)
            gauges["waiting"].add_metric(lv, snap.num_waiting)
            gauges["usage"].add_metric(lv, snap.kv_cache_usage)
            gauges["free"].add_metric(lv, snap.num_free_blocks)
        success = CounterMetricFamily(
            "kvsched_request_success",
            "Finished requests by reason (stop, length, abort, error).",
            labels=[*labels, "finished_reason"],
        )
        hists = {
            attr: HistogramMetricFamily(f"kvsched_{name}", doc, labels=labels)
            for attr, (name, doc) in _HISTS.items()
        }
        for iid, m in list(mx.instances.items()):
            published = facts.get(iid)
            lv = [iid, (published.model if published is not None else "") or mx.model]
            totals = published.counters if published is not None else {}
            for family, name in zip(counters, SNAPSHOT_COUNTERS, strict=True):
                family.add_metric(lv, totals.get(name, 0))
            for reason, n in list(m.finished.items()):
                success.add_metric([*lv, reason], n)
            for attr, hist_family in hists.items():
                h: Hist = getattr(m, attr)
                hist_family.add_metric(lv, h.cumulative(), h.sum)
        yield ready
        yield accepting
        yield from gauges.values()
        yield from counters
        yield success
        yield from hists.values()
        yield from step_cost_families(facts, model, labels)
        yield from mx.tenants.families(facts, model)
        yield from host_tier_families(facts, model, labels)
        yield from lora_families(facts, model)
        yield from cluster_families(mx.cluster_facts(), model)
        yield from mx.refusals.families(model)
