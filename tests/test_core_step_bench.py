"""The core benchmark's harness measures what it says: a steady decode step (structure only;
timing is the benchmark's business)."""

from bench.core_step import Steady


def test_the_benchmark_reaches_a_steady_decode_step_and_stays_there() -> None:
    bench = Steady(running=32, waiting=50)
    s = bench.s
    assert s.num_running == s.num_decoding == 32 and s.num_waiting == 50
    out_before = {r.req_id: r.num_output_tokens for r in s.running.values()}
    for _ in range(200):  # past several block extensions per request
        bench.step()
        s.check_integrity()
    record = bench.record([0, 0, 0])
    assert record["steps"] == 200 and record["worker_paused_rows"] == 0
    # Every step gave every running request exactly one token; nothing was admitted.
    assert {r.req_id: r.num_output_tokens - out_before[r.req_id] for r in s.running.values()} == {
        rid: 200 for rid in out_before
    }
    assert s.stats.num_preemptions == 0


def test_the_transport_benchmarks_hot_path_runs_a_full_report() -> None:
    # bench.transport --hot-path steps the same steady state through the daemon's conversion,
    # the core, the sinks and a Session message; every stage must have run.
    import asyncio

    from bench.transport import HOT_STAGES, hot_path

    times = asyncio.run(hot_path(16, 5))
    assert set(times) == {*HOT_STAGES, "total"}
    assert all(times[k] > 0 for k in HOT_STAGES)
