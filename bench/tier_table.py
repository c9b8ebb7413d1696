"""`bench.tier_compare`'s printed table: per configuration the sim and replay rows side by side
(hit rates, queue and service time, TTFT p50 against gpu-only, goodput), the prefetched share,
worker steps and the per-request differences."""

from __future__ import annotations

from typing import Any


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(out: dict[str, Any]) -> str:
    head = (
        f"{'config':12} {'run':6} {'hit %':>6} {'host %':>6} {'stor %':>6} {'queue p50':>9} "
        f"{'mean':>6} {'svc p50':>7} {'TTFT p50':>8} {'p90':>6} {'vs gpu':>7} {'goodput':>7}"
    )
    lines = [head, "-" * len(head)]
    base = {run: out["configs"].get("gpu-only", {}).get(run) for run in ("sim", "replay")}
    for name, c in out["configs"].items():
        for run in ("sim", "replay"):
            if run not in c:
                continue
            a, b = c[run]["agg"], base[run]
            vs = "-"
            if b and a["ttft_p50"] and b["agg"]["ttft_p50"]:
                vs = f"{100 * (a['ttft_p50'] / b['agg']['ttft_p50'] - 1):+.0f} %"
            lines.append(
                f"{name:12} {run:6} {100 * a['hit']:>6.1f} {100 * a['host']:>6.1f} "
                f"{100 * a['storage']:>6.1f} {_f(a['queue_p50'], '.3f'):>9} "
                f"{_f(a['queue_mean'], '.2f'):>6} {_f(a['service_p50'], '.3f'):>7} "
                f"{_f(a['ttft_p50'], '.3f'):>8} {_f(a['ttft_p90'], '.2f'):>6} {vs:>7} "
                f"{c[run]['summary']['goodput_rps']:>7.2f}"
            )
        runs = [run for run in ("sim", "replay") if run in c]
        if c["sim"]["agg"]["storage"]:
            pf = [
                f"{r} {100 * c[r]['summary'].get('storage_prefetched_frac', 0):.0f} %" for r in runs
            ]
            lines.append(f"{'':12} {'prefetched before placement':6} {' / '.join(pf)}")
        steps = {run: c[run]["summary"].get("worker_steps") for run in runs}
        if len(steps) == 2:
            a, b = steps["sim"], steps["replay"]
            lines.append(
                f"{'':12} {'steps':6} sim {a['steps']:,} steps, {a['busy_s']:.1f} s busy; replay "
                f"{b['steps']:,} steps, {b['busy_s']:.1f} s busy (wall), "
                f"{b['waiting_on_daemon_s']:.1f} s waiting on the daemon"
            )
        if "diff" in c:
            d = c["diff"]
            lines.append(
                f"{'':12} {'diff':6} same hit tokens {100 * d['same_hit_tokens']:.0f} % of "
                f"requests (replay {d['hit_tokens_replay_minus_sim']:+,} tokens); TTFT "
                f"replay - sim p10/p50/p90 {_f(d['ttft_diff_p10'], '+.3f')} / "
                f"{_f(d['ttft_diff_p50'], '+.3f')} / {_f(d['ttft_diff_p90'], '+.3f')} s; "
                f"queue p50 {_f(d['queue_diff_p50'], '+.3f')} s"
            )
    return "\n".join(lines)
