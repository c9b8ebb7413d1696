"""The discrete-event simulator (bench.simulate) and the shared summary (kvsched.replay.summary)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench.simulate import EventLoop, KvschedCluster, SimResult, simulate
from kvsched.core import CacheConfig, EngineConfig, SchedulerConfig, StepReport, Tasks
from kvsched.data import CONVERSATION_SLICE
from kvsched.replay.summary import RequestRecord, summarize
from kvsched.traces import TraceRequest, load_trace

BLOCK = 16
CONVERSATION = CONVERSATION_SLICE


def make_trace(
    n: int = 50, shared: bool = True, gap_s: float = 0.005, seed: int = 0
) -> list[TraceRequest]:
    """n requests gap_s apart; with `shared`, each starts with one of three 256-token prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 32000) for _ in range(256)] for _ in range(3)]
    trace = []
    for i in range(n):
        tail = [rng.randrange(3, 32000) for _ in range(rng.randint(20, 300))]
        prompt = (prefixes[i % 3] if shared else []) + tail
        trace.append(TraceRequest(i * gap_s, prompt, rng.randint(1, 40)))
    return trace


def make_config(prefix_caching: bool = True, num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(
            block_size=BLOCK, num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
    )


def run(trace: list[TraceRequest], **kw: Any) -> SimResult:
    config = kw.pop("config", None) or make_config()
    kw.setdefault("check", True)  # check_integrity() after every daemon step
    return simulate(trace, KvschedCluster.factory(config, **kw))


def timeline(result: SimResult) -> list[tuple[Any, ...]]:
    return [
        (r.instance, r.first_token_s, r.finish_s, tuple(r.token_times_s)) for r in result.records
    ]


def test_every_request_completes_with_max_tokens_in_consistent_time() -> None:
    trace = make_trace()
    result = run(trace, config=make_config(num_blocks=64))  # tight enough to preempt
    assert result.num_preemptions > 0
    for tr, rec in zip(trace, result.records, strict=True):
        assert rec.finish_reason == "length"
        assert rec.num_output_tokens == tr.max_tokens
        times = rec.token_times_s
        assert rec.first_token_s is not None
        assert rec.arrival_s < rec.first_token_s == times[0]
        assert times == sorted(times)
        assert rec.finish_s == times[-1]
    stats = result.instances[0]
    assert stats.num_steps > 0 and stats.idle_control_plane_s == 0.0
    end = max(r.finish_s for r in result.records if r.finish_s is not None)
    assert 0 < stats.busy_s <= end


def test_runs_are_deterministic() -> None:
    trace = make_trace(30)
    assert timeline(run(trace)) == timeline(run(trace))


def test_prefix_caching_decides_the_hit_rate() -> None:
    trace = make_trace()
    on = run(trace, config=make_config(num_blocks=2048)).summary()
    off = run(trace, config=make_config(prefix_caching=False, num_blocks=2048)).summary()
    assert on["prefix_hit_rate"] > 0.3  # 256 of ~420 prompt tokens are shared
    assert off["prefix_hit_rate"] == 0.0
    assert off["completed"] == on["completed"] == len(trace)


def test_summary_fields_are_sane() -> None:
    trace = make_trace()
    s = run(trace, num_instances=2).summary(slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert s["requests"] == s["completed"] == len(trace)
    assert s["output_tokens"] == sum(tr.max_tokens for tr in trace)
    assert (s["num_gpu_blocks"], s["block_size"], s["instances"]) == (256, BLOCK, 2)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = s[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"], key
    assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
    assert 0 < s["goodput_rps"] * s["duration_s"] <= s["completed"]
    assert s["output_tokens_per_s"] > 0 and 0 <= s["prefix_hit_rate"] <= 1
    assert s["preemptions"] >= 0 and s["rejected"] == 0
    cpu = s["scheduler_cpu_us_per_step"]
    assert cpu["mean"] > 0 and cpu["p50"] <= cpu["p99"]
    assert 0 < s["worker_busy_frac"] <= 1
    assert {r.instance for r in run(trace, num_instances=2).records} == {0, 1}


def test_tasks_planned_after_report_n_run_at_step_n_plus_2() -> None:
    # One long decode keeps the worker busy, so it never waits for the daemon.
    trace = [TraceRequest(0.0, list(range(3, 40)), 300)] + [
        TraceRequest(0.05 + 0.1 * i, list(range(100 + i, 900 + i)), 3) for i in range(5)
    ]
    loop = EventLoop()
    cluster = KvschedCluster(loop, make_config(), check=True)
    inst = cluster.instances[0]
    made_after: dict[int, int] = {}  # Tasks.seq -> the report step it was planned after
    delivered: list[int] = []
    applied: list[tuple[int, int]] = []  # (step, highest Tasks.seq the worker had applied)
    daemon_step, deliver = inst._daemon_step, inst._deliver

    def spy_daemon(report: StepReport | None) -> None:
        daemon_step(report)
        if report is not None:
            applied.append((report.step, report.applied_seq))
            made_after[inst.sched.last_tasks_seq] = report.step

    def spy_deliver(tasks: Tasks, made_s: float) -> None:
        delivered.append(tasks.seq)
        deliver(tasks, made_s)

    inst._daemon_step = spy_daemon  # type: ignore[method-assign]
    inst._deliver = spy_deliver  # type: ignore[method-assign]
    for i, tr in enumerate(trace):
        rec = RequestRecord(f"q{i}", tr.arrival_s, len(tr.prompt_token_ids), tr.max_tokens)
        loop.at(tr.arrival_s, cluster.submit, tr, rec)
    loop.run()
    checked = [seq for seq in delivered if seq in made_after]
    assert len(checked) > 10
    for seq in checked:
        first = min(step for step, s in applied if s >= seq)
        assert first == made_after[seq] + 2, (seq, made_after[seq], first)
    assert rec.finish_reason == "length" and cluster.instances[0].stats.idle_s == 0.0


def test_control_latency_shows_as_control_plane_idle() -> None:
    trace = make_trace(10, gap_s=1.0)  # the worker idles between requests
    assert run(trace).summary()["worker_idle_frac_control_plane"] == 0.0
    slow = run(trace, control_latency_s=0.002).summary()
    assert slow["worker_idle_frac_control_plane"] > 0
    assert slow["completed"] == len(trace)


def test_summary_by_hand() -> None:
    recs = [
        RequestRecord("a", 0.0, 100, 3, first_token_s=1.0, finish_s=1.2,
                      token_times_s=[1.0, 1.1, 1.2], num_cached_tokens=50, finish_reason="length"),
        RequestRecord("b", 1.0, 100, 1, first_token_s=4.0, finish_s=4.0,
                      token_times_s=[4.0], finish_reason="stop"),
        RequestRecord("c", 2.0, 100, 5, finish_reason="rejected"),
    ]  # fmt: skip
    s = summarize(recs, num_gpu_blocks=8, block_size=4, preemptions=2, slo_ttft_s=2.0,
                  slo_tpot_s=0.2)  # fmt: skip
    assert (s["requests"], s["completed"], s["output_tokens"]) == (3, 2, 4)
    assert s["duration_s"] == 4.0 and s["output_tokens_per_s"] == 1.0
    assert s["goodput_rps"] == 0.25  # only "a": b's TTFT is 3 s
    assert s["ttft_s"]["p50"] == pytest.approx(2.0) and s["tpot_s"]["p50"] == pytest.approx(0.1)
    assert s["itl_s"]["p99"] == pytest.approx(0.1)
    assert s["prefix_hit_rate"] == 0.25


def test_mooncake_slice_completes() -> None:
    trace = load_trace(CONVERSATION, max_requests=50)  # ~12k-token prompts: no per-step check
    config = make_config(num_blocks=8192)
    config.cache.block_size = 64
    result = run(trace, config=config, num_instances=2, check=False)
    s = result.summary()
    assert s["completed"] == 50 and s["output_tokens"] == sum(t.max_tokens for t in trace)


def test_a_host_tier_keeps_prefixes_a_small_gpu_pool_evicts() -> None:
    """Three shared 256-token prefixes (16 blocks each) taken in turn, a GPU pool of 40 blocks
    (about one request at a time, so each prefix is evicted before it comes round again), and
    a host tier of 4x: write_back swaps the evicted prefixes back in, the copies are priced into
    the sim's step times; check_integrity after every daemon step (both pools, every pin)."""
    trace = make_trace(n=60, gap_s=0.05)
    config = make_config(num_blocks=40)
    without = run(trace, config=config).summary()
    config.cache.num_host_blocks = 160
    config.cache.host_write_policy = "write_back"  # type: ignore[assignment]
    with_tier = run(trace, config=config).summary()
    assert with_tier["completed"] == without["completed"] == len(trace)
    assert with_tier["num_host_blocks"] == 160 and without["num_host_blocks"] == 0
    assert without["prefix_hit_rate"] < 0.1, "the GPU pool was meant to lose the prefixes"
    assert with_tier["swap_ins"] > 0 and with_tier["host_hit_rate"] > 0.4
    assert with_tier["prefix_hit_rate"] > 0.5
